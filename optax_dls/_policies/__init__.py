"""Loss-scale policies: pure ``init`` / ``update`` pairs over a small state (:mod:`.base`). The
dynamic rule (:mod:`.dynamic`) backs the dynamic, static and no-op policies and the framework
presets (:mod:`.presets`); :mod:`.amax` follows the gradients' magnitude; :mod:`.fallback` wraps a
policy with a float32 fallback and a count of skips at ``min_scale``.

May import: ``_util`` only."""

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
