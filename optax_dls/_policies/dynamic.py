"""The dynamic rule (Micikevicius et al. 2018, Sec. 3.2): the dynamic, static and no-op policies."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._policies.base import GradStats, LossScalePolicy
from optax_dls._util import validation as _validation


class DynamicScaleState(NamedTuple):
  """Policy state of the dynamic rule, held constant by the static and no-op policies (fields:
  :func:`dynamic_policy`'s Returns)."""

  growth_tracker: jax.Array
  hysteresis_left: jax.Array

  def after_scale_reset(self) -> DynamicScaleState:
    """After :func:`optax_dls.reset_scale`: the growth count restarts at 0."""
    return self._replace(growth_tracker=jnp.zeros_like(self.growth_tracker))


def _dynamic_state(hysteresis: int) -> DynamicScaleState:
  return DynamicScaleState(jnp.zeros([], jnp.int32), jnp.asarray(hysteresis, jnp.int32))


class DynamicRule(NamedTuple):
  """The dynamic rule's checked settings, with the established scalers' variations: one of
  ``backoff_factor`` / ``backoff_divisor`` is None; ``reset_after_growth`` restarts the tracker."""

  init_scale: float
  min_scale: float
  max_scale: float
  growth_factor: float
  growth_interval: int
  backoff_factor: float | None = None
  backoff_divisor: float | None = None
  reset_after_growth: int = 0
  hysteresis: int = 1
  consecutive_hysteresis: bool = False
  warmup_steps: int = 0


def _rule_init(rule: DynamicRule) -> tuple[jax.Array, DynamicScaleState]:
  return jnp.asarray(rule.init_scale, jnp.float32), _dynamic_state(rule.hysteresis)


def _rule_update(
  rule: DynamicRule, scale: jax.Array, state: DynamicScaleState, stats: GradStats
) -> tuple[jax.Array, DynamicScaleState]:
  finite = stats.finite
  tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
  grow = finite & (tracker >= rule.growth_interval) & (stats.step >= rule.warmup_steps)
  left = jnp.maximum(state.hysteresis_left - 1, 0)
  backoff = ~finite & (left == 0)
  if rule.backoff_divisor is None:
    backed = scale * jnp.float32(rule.backoff_factor)
  else:
    backed = scale / jnp.float32(rule.backoff_divisor)
  grown = jnp.minimum(scale * jnp.float32(rule.growth_factor), jnp.float32(rule.max_scale))
  backed = jnp.maximum(backed, jnp.float32(rule.min_scale))
  new_scale = jnp.where(grow, grown, jnp.where(backoff, backed, scale))
  full = jnp.asarray(rule.hysteresis, jnp.int32)
  kept = full if rule.consecutive_hysteresis else state.hysteresis_left
  new_state = DynamicScaleState(
    growth_tracker=jnp.where(grow, rule.reset_after_growth, tracker).astype(jnp.int32),
    hysteresis_left=jnp.where(finite, jnp.where(grow, full, kept), left).astype(jnp.int32),
  )
  return new_scale.astype(jnp.float32), new_state


def dynamic_rule(rule: DynamicRule) -> LossScalePolicy:
  """The policy of a checked :class:`DynamicRule`; products and quotients float32, rounded once."""
  return LossScalePolicy(
    functools.partial(_rule_init, rule),
    functools.partial(_rule_update, rule),
    min_scale=rule.min_scale,
    max_scale=rule.max_scale,
  )


def dynamic_policy(
  init_scale: float = 2.0**15,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  min_scale: float = 1.0,
  max_scale: float = 2.0**24,
  hysteresis: int = 1,
  consecutive_hysteresis: bool = False,
  warmup_steps: int = 0,
) -> LossScalePolicy:
  """Dynamic loss scaling (Micikevicius et al. 2018, Mixed Precision Training).

  The scale grows by ``growth_factor`` (to at most ``max_scale``, refilling the hysteresis) on
  the ``growth_interval``-th consecutive finite step, as in PyTorch, jmp and Keras, once
  ``warmup_steps`` updates have run; a non-finite step uses up one hysteresis, and with none
  left backs off by ``backoff_factor`` (to at least ``min_scale``).

  Args:
    init_scale: float in ``[min_scale, max_scale]``, the initial loss scale. Default ``2**15``.
    growth_factor: float > 1, finite, and in float32 (not within ~6e-8 of 1). Default 2.
    backoff_factor: float in (0, 1), also in float32 (not within ~3e-8 of 1, nor below ~1e-45).
      Default 0.5.
    growth_interval: int in [1, 2**31 - 1], consecutive finite steps before a growth. Default 2000.
    min_scale: float in [2**-126, 2**126], floor of the scale. Default 1.
    max_scale: float in [min_scale, 2**126], ceiling of the scale (never inf). Default ``2**24``.
    hysteresis: int in [1, 2**31 - 1], overflows tolerated before a backoff (DeepSpeed
      ``delayed_shift``, Megatron ``hysteresis``). Default 1: every overflow backs off (PyTorch).
    consecutive_hysteresis: bool. If True every finite step refills the hysteresis
      (DeepSpeed's option), else only a growth does (Megatron). Default False.
    warmup_steps: int in [0, 2**31 - 1]. No growth before this many updates. Default 0.

  Returns:
    A :class:`LossScalePolicy` whose state is a ``DynamicScaleState`` of int32 ``()`` fields
    ``growth_tracker`` (finite steps since the last growth or overflow) and ``hysteresis_left``.

  Raises:
    ValueError: a value outside its valid range; the message names it.
    TypeError: a value of the wrong type, or a traced (non-static) value.

  Example:
    >>> import jax.numpy as jnp, optax_dls
    >>> policy = optax_dls.dynamic_policy(init_scale=8.0, growth_interval=2)
    >>> scale, state = policy.init()
    >>> for finite in [True, True, False]:
    ...   stats = optax_dls._policies.GradStats(finite=jnp.array(finite), step=jnp.array(0),
    ...     grad_norm=jnp.array(1.0))
    ...   scale, state = policy.update(scale, state, stats)
    ...   print(float(scale))
    8.0
    16.0
    8.0
  """
  growth_factor = _validation.growth_factor("growth_factor", growth_factor)
  backoff_factor = _validation.backoff_factor("backoff_factor", backoff_factor)
  growth_interval = _validation.count("growth_interval", growth_interval)
  init_scale, min_scale, max_scale = _validation.scale_range(
    ("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)
  )
  rule = DynamicRule(
    init_scale=init_scale,
    min_scale=min_scale,
    max_scale=max_scale,
    growth_factor=growth_factor,
    growth_interval=growth_interval,
    backoff_factor=backoff_factor,
    hysteresis=_validation.count("hysteresis", hysteresis),
    consecutive_hysteresis=_validation.boolean("consecutive_hysteresis", consecutive_hysteresis),
    warmup_steps=_validation.count("warmup_steps", warmup_steps, low=0),
  )
  return dynamic_rule(rule)


def static_policy(scale: float) -> LossScalePolicy:
  """The policy of :func:`~optax_dls.static_loss_scale`: ``scale`` in ``[2**-126, 2**126]``, fixed;
  non-finite steps skipped; the dynamic policy's state, held constant."""
  scale = _validation.scale("scale", scale)
  init = functools.partial(_static_init, scale)
  return LossScalePolicy(init, _static_update, min_scale=scale, max_scale=scale)


def _static_init(scale: float) -> tuple[jax.Array, DynamicScaleState]:
  return jnp.asarray(scale, jnp.float32), _dynamic_state(1)


def _static_update(
  scale: jax.Array, state: DynamicScaleState, stats: GradStats
) -> tuple[jax.Array, DynamicScaleState]:
  del stats
  return scale, state


def noop_policy() -> LossScalePolicy:
  """The policy of :func:`~optax_dls.no_loss_scale`: S = 1, ``passthrough=True``."""
  return static_policy(1.0)._replace(passthrough=True)
