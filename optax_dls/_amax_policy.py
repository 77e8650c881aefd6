"""A gradient-aware loss-scale policy: move the scale before an overflow, not after.

The dynamic rule of Micikevicius et al. (2018), *Mixed Precision Training*,
learns the largest safe scale only by overflowing. This policy instead keeps a
short history of the gradients' magnitude and sets the scale so that the
largest scaled gradient sits ``margin`` powers of two below the float16
maximum, the recipe of delayed scaling for FP8 (Micikevicius et al. 2022,
*FP8 Formats for Deep Learning*; NVIDIA Transformer Engine
``DelayedScaling``: ``scale = fp8_max / amax / 2**margin`` from an amax
history).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls import _validation as v
from optax_dls._policy import SCALE_MAX, SCALE_MIN, GradStats, LossScalePolicy

_STATISTICS = ("amax", "grad_norm")


class AmaxScaleState(NamedTuple):
  """Policy state of :func:`amax_policy`.

  Attributes:
    amax_history: float32 ``[history_len]``. The unscaled gradient statistic
      (amax or global norm) of the last ``history_len`` steps, newest first;
      0 marks an empty slot. A non-finite step at scale S records
      ``max_value / S``, the least magnitude that overflows at S.
    growth_tracker: int32 ``()``. Consecutive finite steps since the scale
      last moved.
  """

  amax_history: jax.Array
  growth_tracker: jax.Array


def _pow2_floor(x: jax.Array) -> jax.Array:
  """The largest power of two <= x, for normal positive float32 x."""
  _, exponent = jnp.frexp(x)
  return jnp.ldexp(jnp.ones([], jnp.float32), exponent - 1)


def amax_policy(
    init_scale: float = 2.0**15,
    margin: float = 2.0,
    history_len: int = 16,
    growth_interval: int = 16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    max_value: float = 65504.0,
    statistic: str = "amax",
) -> LossScalePolicy:
  """Gradient-aware loss scaling: keep the scaled amax ``margin`` octaves below fp16 max.

  Each step records the unscaled gradient statistic ``a`` (the amax of the
  scaled gradients divided by S, or the global norm) in a fixed-length
  history and computes the target scale
  ``T = pow2_floor(max_value / 2**margin / max(history))``, clipped to
  ``[min_scale, max_scale]``: the largest power of two at which every recent
  scaled gradient stays below ``max_value / 2**margin``.

  * Finite step, ``T < S``: back off to ``T`` at once, before any overflow.
  * Finite step, ``T > S`` and ``growth_interval`` consecutive finite steps
    since the scale last moved: grow to ``min(S * growth_factor, T)``.
  * Non-finite step (skipped by the wrapper): ``S = max(S * backoff_factor,
    min_scale)`` as in the dynamic rule, and ``max_value / S`` enters the
    history (an overflow at S means the magnitude was at least that), which
    holds the scale down for the next ``history_len`` steps.

  What the amax means: it is taken over the gradients the optimizer receives.
  When the master parameters are float32 and cast to float16 inside the
  model, those are the float16 parameter gradients upcast, so their scaled
  amax is exactly the largest float16 parameter-gradient entry and is below
  65504 on every finite step. Activation cotangents inside the network are not
  seen; they can be larger than any parameter gradient, which is what
  ``margin`` absorbs. With ``statistic="grad_norm"`` the (larger) global norm
  stands in for the amax, a more conservative choice.

  Args:
    init_scale: float, the first scale, in ``[min_scale, max_scale]``.
      Default ``2**15``.
    margin: float in [0, 64], octaves of headroom below ``max_value``.
      Default 2 (scaled amax at most a quarter of the float16 maximum); it
      must cover the step-to-step jumps of the amax, which are often one to
      three octaves with small batches (see ``docs/policies.md``).
    history_len: int in [1, 4096], steps in the history. Default 16.
    growth_interval: int in [1, 2**31 - 1], consecutive finite steps between
      two growths. Default 16.
    growth_factor: float > 1, the largest growth per step. Default 2.
    backoff_factor: float in (0, 1), backoff on a non-finite step. Default 0.5.
    min_scale: float in [2**-126, 2**126], floor of the scale. Default 1.
    max_scale: float in [2**-126, 2**126], ceiling of the scale. Default
      ``2**24``.
    max_value: float, the largest finite value of the compute dtype; it and
      ``max_value * 2**-margin`` must be normal finite float32 numbers
      (``2**-126 <= value < 3.4e38``). Default 65504 (float16).
    statistic: ``"amax"`` (default; asks the wrapper for the amax) or
      ``"grad_norm"``.

  Returns:
    A :class:`LossScalePolicy` whose state is an :class:`AmaxScaleState`.

  Raises:
    ValueError: a value outside its range; the message names it.
    TypeError: a wrong type, or a traced value where a static number is needed.
  """
  init_scale = v.real("init_scale", init_scale)
  margin = v.real("margin", margin)
  v.check(0.0 <= margin <= 64.0, "margin", margin, "0 <= value <= 64")
  history_len = v.integer("history_len", history_len)
  v.check(1 <= history_len <= 4096, "history_len", history_len, "1 <= value <= 4096")
  growth_interval = v.integer("growth_interval", growth_interval)
  v.check(1 <= growth_interval <= v.INT32_MAX, "growth_interval", growth_interval, "1 <= value <= 2**31 - 1")
  growth_factor = v.growth_factor("growth_factor", growth_factor)
  backoff_factor = v.backoff_factor("backoff_factor", backoff_factor)
  for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
    value = v.real(name, value)
    v.check(SCALE_MIN <= value <= SCALE_MAX, name, value, "2**-126 <= value <= 2**126")
  min_scale, max_scale = float(min_scale), float(max_scale)
  v.check(min_scale <= max_scale, "max_scale", max_scale, f"max_scale >= min_scale={min_scale!r}")
  v.check(min_scale <= init_scale <= max_scale, "init_scale", init_scale,
          f"min_scale={min_scale!r} <= init_scale <= max_scale={max_scale!r}")
  max_value = v.real("max_value", max_value)
  v.check(0.0 < max_value < float("inf"), "max_value", max_value, "0 < value < inf")
  tiny = float(np.finfo(np.float32).tiny)
  v.float32("max_value", max_value, lambda r: tiny <= r < math.inf,
            "2**-126 <= value < inf (a normal number)")
  v.float32("max_value * 2**-margin", max_value * 2.0**-margin, lambda r: tiny <= r < math.inf,
            "2**-126 <= value < inf (a normal number)")
  if not isinstance(statistic, str):
    raise TypeError(f"statistic must be a string, one of {_STATISTICS}, got {statistic!r} "
                    f"of type {type(statistic).__name__}.")
  if statistic not in _STATISTICS:
    raise ValueError(f"statistic must be one of {_STATISTICS}, got statistic={statistic!r}.")
  headroom = jnp.float32(max_value * 2.0**-margin)
  lo, hi = jnp.float32(min_scale), jnp.float32(max_scale)

  def init():
    return (jnp.asarray(init_scale, jnp.float32),
            AmaxScaleState(jnp.zeros([history_len], jnp.float32), jnp.zeros([], jnp.int32)))

  def update(scale: jax.Array, state: AmaxScaleState, stats: GradStats) -> tuple[jax.Array, Any]:
    finite = stats.finite
    observed = stats.amax / scale if statistic == "amax" else stats.grad_norm
    observed = jnp.where(finite, observed, jnp.float32(max_value) / scale).astype(jnp.float32)
    history = jnp.roll(state.amax_history, 1).at[0].set(observed)
    peak = jnp.max(history)
    raw = jnp.where(peak > 0, headroom / jnp.maximum(peak, jnp.finfo(jnp.float32).tiny), hi)
    target = jnp.maximum(_pow2_floor(jnp.clip(raw, lo, hi)), lo)
    tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
    shrink = finite & (target < scale)
    grow = finite & (target > scale) & (tracker >= growth_interval)
    new_scale = jnp.where(
        shrink, target,
        jnp.where(grow, jnp.minimum(scale * jnp.float32(growth_factor), target),
                  jnp.where(finite, scale, jnp.maximum(scale * jnp.float32(backoff_factor), lo))))
    moved = shrink | grow
    return new_scale.astype(jnp.float32), AmaxScaleState(
        history, jnp.where(moved, 0, tracker).astype(jnp.int32))

  return LossScalePolicy(init, update, stats=("amax",) if statistic == "amax" else ())
