"""Policy wrappers: a float32 fallback flag after a run of skips; the skips at ``min_scale``."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._policies.base import GradStats, LossScalePolicy, check_policy
from optax_dls._util import validation as _validation


class FallbackState(NamedTuple):
  """Policy state of :func:`fp32_fallback`: the wrapped ``policy_state``, the ``fp32_fallback``
  flag (bool ``()``), its ``steps_left`` and the ``consecutive_skips`` (int32 ``()``)."""

  policy_state: Any
  fp32_fallback: jax.Array
  steps_left: jax.Array
  consecutive_skips: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    return {"fp32_fallback": self.fp32_fallback}


def fp32_fallback(
  policy: LossScalePolicy, *, after: int = 10, steps: int = 100, scale: float | None = None
) -> LossScalePolicy:
  """Wraps ``policy`` with a float32 fallback for when float16 keeps failing.

  After ``after`` consecutive skips the ``fp32_fallback`` flag (in :func:`metrics`) is on for the
  next ``steps`` updates while the wrapped policy keeps moving the scale; the update that ends it
  restarts the scale at ``scale`` and the wrapped policy's state. Pick the computation by the
  flag (both traced once, never recompiled; of the same structure, shapes and dtypes)::

      loss = jax.lax.cond(
        optax_dls.metrics(opt_state)["fp32_fallback"], fp32_loss, fp16_loss, params, batch
      )

  :func:`metrics` also reports ``skips_at_min_scale``, the consecutive skips at the policy's
  ``min_scale`` that backing off cannot cure (reset by an applied step and when the fallback
  ends); :class:`SkipAlerts` warns on the first.

  Args:
    policy: the :class:`LossScalePolicy` to wrap, e.g. :func:`dynamic_policy`.
    after: int in [1, 2**31 - 1], consecutive skipped steps that start the fallback. Default 10.
    steps: int in [1, 2**31 - 1], updates the fallback lasts. Default 100.
    scale: float in the policy's ``[min_scale, max_scale]``, or None (the default: the policy's
      initial scale), the scale to restart at.

  Returns:
    A :class:`LossScalePolicy` whose state is a ``FallbackState`` (above); its ``policy_state``, a
    ``SkipsAtMinScaleState``, holds the wrapped state and ``skips_at_min_scale`` (int32 ``()``).

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`, or a wrong type or traced value.
    ValueError: a value out of range (named), ``scale`` included, or ``policy``'s ``stats``,
      scale range or initial scale is not valid.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> dynamic = optax_dls.dynamic_policy(min_scale=2.0**15)
    >>> policy = optax_dls.fp32_fallback(dynamic, after=2)
    >>> tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
    >>> state = tx.init({'w': jnp.ones(1)})
    >>> for _ in range(2):
    ...   _, state = tx.update({'w': jnp.array([jnp.nan])}, state)
    >>> m = optax_dls.metrics(state)
    >>> bool(m['fp32_fallback']), int(m['skips_at_min_scale'])
    (True, 2)
  """
  policy = check_policy(policy)
  after = _validation.count("after", after)
  steps = _validation.count("steps", steps)
  if scale is not None:
    scale = _validation.scale("scale", scale, policy.min_scale, policy.max_scale)
  counted = skips_at_min_scale(policy)
  init = functools.partial(_fallback_init, counted)
  update = functools.partial(_fallback_update, counted, after, steps, scale)
  return policy._replace(init=init, update=update)


def _fallback_init(policy: LossScalePolicy) -> tuple[jax.Array, FallbackState]:
  init_scale, policy_state = policy.init()
  off = jnp.zeros([], jnp.int32)
  return init_scale, FallbackState(policy_state, jnp.zeros([], jnp.bool_), off, off)


def _fallback_update(
  policy: LossScalePolicy,
  after: int,
  steps: int,
  scale: float | None,
  loss_scale: jax.Array,
  state: FallbackState,
  stats: GradStats,
) -> tuple[jax.Array, FallbackState]:
  new_scale, policy_state = policy.update(loss_scale, state.policy_state, stats)
  consecutive = jnp.where(stats.finite, 0, optax.safe_increment(state.consecutive_skips))
  active = state.fp32_fallback
  ended = active & (state.steps_left <= 1)
  start = ~active & ~stats.finite & (consecutive >= after)
  left = jnp.where(active, jnp.maximum(state.steps_left - 1, 0), jnp.where(start, steps, 0))
  restart_scale, restart_state = policy.init()
  restart = restart_scale if scale is None else jnp.float32(scale)
  new_scale = jnp.where(ended, restart, new_scale).astype(jnp.float32)
  policy_state = jax.tree.map(
    lambda a, b: jnp.where(ended, a, b).astype(jnp.result_type(b)), restart_state, policy_state
  )
  return new_scale, FallbackState(
    policy_state, (active & ~ended) | start, left.astype(jnp.int32), consecutive.astype(jnp.int32)
  )


class SkipsAtMinScaleState(NamedTuple):
  """Policy state of :func:`skips_at_min_scale`: ``policy_state``, int32 ``skips_at_min_scale``."""

  policy_state: Any
  skips_at_min_scale: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    return {"skips_at_min_scale": self.skips_at_min_scale}


def skips_at_min_scale(policy: LossScalePolicy) -> LossScalePolicy:
  """``policy`` counting the consecutive skips at its ``min_scale``; raises as ``check_policy``."""
  policy = check_policy(policy)
  init = functools.partial(_min_scale_init, policy)
  return policy._replace(init=init, update=functools.partial(_min_scale_update, policy))


def _min_scale_init(policy: LossScalePolicy) -> tuple[jax.Array, SkipsAtMinScaleState]:
  scale, policy_state = policy.init()
  return scale, SkipsAtMinScaleState(policy_state, jnp.zeros([], jnp.int32))


def _min_scale_update(
  policy: LossScalePolicy, scale: jax.Array, state: SkipsAtMinScaleState, stats: GradStats
) -> tuple[jax.Array, SkipsAtMinScaleState]:
  new_scale, policy_state = policy.update(scale, state.policy_state, stats)
  at_min = ~stats.finite & (scale <= jnp.float32(policy.min_scale))
  count = jnp.where(at_min, optax.safe_increment(state.skips_at_min_scale), 0)
  return new_scale, SkipsAtMinScaleState(policy_state, count.astype(jnp.int32))
