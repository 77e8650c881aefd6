"""Loss-scale policies, pure ``init`` / ``update`` pairs: the protocol (``base``), the dynamic,
static, no-op and framework policies (``dynamic``, ``presets``), the gradient-aware ``amax``
policy and the float32 ``fallback`` wrapper. May import: ``_util`` only."""

from optax_dls._policies.amax import AmaxScaleState, amax_policy
from optax_dls._policies.base import STATS, GradStats, LossScalePolicy, check_policy
from optax_dls._policies.dynamic import (
  DynamicRule,
  DynamicScaleState,
  dynamic_policy,
  dynamic_rule,
  noop_policy,
  static_policy,
)
from optax_dls._policies.fallback import (
  FallbackState,
  SkipsAtMinScaleState,
  fp32_fallback,
  skips_at_min_scale,
)

__all__ = [
  "STATS",
  "AmaxScaleState",
  "DynamicRule",
  "DynamicScaleState",
  "FallbackState",
  "GradStats",
  "LossScalePolicy",
  "SkipsAtMinScaleState",
  "amax_policy",
  "check_policy",
  "dynamic_policy",
  "dynamic_rule",
  "fp32_fallback",
  "noop_policy",
  "skips_at_min_scale",
  "static_policy",
]
