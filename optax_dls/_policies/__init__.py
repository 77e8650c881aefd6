"""Loss-scale policies: the programmable rule that moves the loss scale.

A policy is a pair of pure functions over a small policy-state pytree, in the
style of an optax ``GradientTransformation`` (:mod:`.base`). The dynamic rule
is written once (:mod:`.dynamic`) and reused by the dynamic, static and no-op
policies and by every framework preset of :func:`optax_dls.config.preset`;
:mod:`.amax` follows the gradients' magnitude. The float32 fallback
(:mod:`.fallback`) is a policy wrapper that owns state beside the wrapped
policy's, with the count of skips at the minimum scale (:mod:`.min_scale`). The
framework presets, each a dynamic rule with another framework's settings, are
in :mod:`.presets`.

May import: ``_util`` only; the core applies a policy, a policy knows nothing of the
core.
"""

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
from optax_dls._policies.fallback import FallbackState, fp32_fallback
from optax_dls._policies.min_scale import SkipsAtMinScaleState, skips_at_min_scale

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
