"""Gradient-aware loss scaling: the scale follows a short history of the gradients' magnitude."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls._policies.base import GradStats, LossScalePolicy
from optax_dls._util import validation as _validation


class AmaxScaleState(NamedTuple):
  """Policy state of :func:`amax_policy`: ``amax_history``, float32 ``[history_len]``, the
  unscaled statistic of the last steps, newest first (0 if empty; ``max_value / S`` for a
  non-finite step), and ``growth_tracker``, int32 ``()``, consecutive finite steps since the
  scale last moved."""

  amax_history: jax.Array
  growth_tracker: jax.Array

  def after_scale_reset(self) -> AmaxScaleState:
    """After :func:`optax_dls.reset_scale`: the growth count restarts at 0."""
    return self._replace(growth_tracker=jnp.zeros_like(self.growth_tracker))


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

  Delayed scaling, as for FP8 (Micikevicius et al. 2022, *FP8 Formats for Deep Learning*;
  Transformer Engine ``DelayedScaling``): each step records the unscaled statistic (the scaled amax
  over S, or the global norm) and targets ``T = pow2_floor(max_value / 2**margin / max(history))``,
  clipped to ``[min_scale, max_scale]``. A finite step with ``T < S`` backs off to ``T`` at once;
  with ``T > S``, after ``growth_interval`` consecutive finite steps since the scale last moved,
  it grows to ``min(S * growth_factor, T)``. A non-finite step sets
  ``S = max(S * backoff_factor, min_scale)`` and records ``max_value / S``, holding the scale down
  for ``history_len`` steps. ``margin`` absorbs activation cotangents larger than the gradients.

  Args:
    init_scale: float, the first scale, in ``[min_scale, max_scale]``. Default ``2**15``.
    margin: float in [0, 64], octaves of headroom below ``max_value``. Default 2.
    history_len: int in [1, 4096], steps in the history. Default 16.
    growth_interval: int in [1, 2**31 - 1], consecutive finite steps per growth. Default 16.
    growth_factor: float > 1, the largest growth per step. Default 2.
    backoff_factor: float in (0, 1), backoff on a non-finite step. Default 0.5.
    min_scale: float in [2**-126, 2**126], floor of the scale. Default 1.
    max_scale: float in [min_scale, 2**126], ceiling of the scale. Default ``2**24``.
    max_value: float, the largest finite value of the compute dtype; it and
      ``max_value * 2**-margin`` must be normal finite float32 numbers. Default 65504 (float16).
    statistic: ``"amax"`` (default; asks the wrapper for the amax) or ``"grad_norm"``.

  Returns:
    A :class:`LossScalePolicy` whose state is an ``AmaxScaleState`` (above).

  Raises:
    ValueError: a value outside its range; the message names it.
    TypeError: a wrong type, or a traced value where a static number is needed.
  """
  init_scale, min_scale, max_scale = _validation.scale_range(
    ("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)
  )
  margin = _validation.real("margin", margin)
  _validation.check(0.0 <= margin <= 64.0, "margin", margin, "0 <= value <= 64")
  history_len = _validation.count("history_len", history_len, high=4096)
  growth_interval = _validation.count("growth_interval", growth_interval)
  growth_factor = _validation.growth_factor("growth_factor", growth_factor)
  backoff_factor = _validation.backoff_factor("backoff_factor", backoff_factor)
  max_value = _validation.real("max_value", max_value)
  _validation.check(0.0 < max_value < math.inf, "max_value", max_value, "0 < value < inf")
  tiny = float(np.finfo(np.float32).tiny)
  normal = lambda r: tiny <= r < math.inf
  for name, value in (("max_value", max_value), ("max_value * 2**-margin", max_value * 2**-margin)):
    _validation.float32(name, value, normal, "2**-126 <= value < inf (a normal number)")
  if not isinstance(statistic, str) or statistic not in ("amax", "grad_norm"):
    kind = ValueError if isinstance(statistic, str) else TypeError
    raise kind(f"statistic must be 'amax' or 'grad_norm', got statistic={statistic!r}.")
  headroom = max_value * 2.0**-margin
  scales = (init_scale, history_len, statistic, max_value, headroom, min_scale, max_scale)
  rule = _AmaxRule(*scales, growth_interval, growth_factor, backoff_factor)
  return LossScalePolicy(
    functools.partial(_amax_init, rule),
    functools.partial(_amax_update, rule),
    stats=("amax",) if statistic == "amax" else (),
    min_scale=min_scale,
    max_scale=max_scale,
  )


class _AmaxRule(NamedTuple):
  """The checked settings of :func:`amax_policy`; ``headroom`` is ``max_value * 2**-margin``."""

  init_scale: float
  history_len: int
  statistic: str
  max_value: float
  headroom: float
  min_scale: float
  max_scale: float
  growth_interval: int
  growth_factor: float
  backoff_factor: float


def _amax_init(rule: _AmaxRule) -> tuple[jax.Array, AmaxScaleState]:
  state = AmaxScaleState(jnp.zeros([rule.history_len], jnp.float32), jnp.zeros([], jnp.int32))
  return jnp.asarray(rule.init_scale, jnp.float32), state


def _amax_update(
  rule: _AmaxRule, scale: jax.Array, state: AmaxScaleState, stats: GradStats
) -> tuple[jax.Array, AmaxScaleState]:
  lo, hi = jnp.float32(rule.min_scale), jnp.float32(rule.max_scale)
  finite = stats.finite
  amax = stats.amax if stats.amax is not None else stats.grad_norm  # "amax" is asked for
  observed = amax / scale if rule.statistic == "amax" else stats.grad_norm
  observed = jnp.where(finite, observed, jnp.float32(rule.max_value) / scale).astype(jnp.float32)
  history = jnp.roll(state.amax_history, 1).at[0].set(observed)
  peak = jnp.max(history)
  headroom = jnp.float32(rule.headroom)
  raw = jnp.where(peak > 0, headroom / jnp.maximum(peak, jnp.finfo(jnp.float32).tiny), hi)
  _, exponent = jnp.frexp(jnp.clip(raw, lo, hi))  # the largest power of two <= it: the target
  target = jnp.maximum(jnp.ldexp(jnp.ones([], jnp.float32), exponent - 1), lo)
  tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
  shrink = finite & (target < scale)
  grow = finite & (target > scale) & (tracker >= rule.growth_interval)
  grown = jnp.minimum(scale * jnp.float32(rule.growth_factor), target)
  backed = jnp.maximum(scale * jnp.float32(rule.backoff_factor), lo)
  new_scale = jnp.where(shrink, target, jnp.where(grow, grown, jnp.where(finite, scale, backed)))
  state = AmaxScaleState(history, jnp.where(shrink | grow, 0, tracker).astype(jnp.int32))
  return new_scale.astype(jnp.float32), state
