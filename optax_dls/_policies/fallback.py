"""Float32 fallback: run the loss in float32 for a while after a run of skipped steps.

A policy wrapper owns the flag and the scale: after ``after`` consecutive
skips it turns the flag on for ``steps`` updates, then restarts the wrapped
policy at ``scale``. The step reads the flag from ``optax_dls.metrics`` to pick
the float16 or the float32 computation with ``jax.lax.cond``. It also counts the
consecutive skips taken at the policy's minimum scale (:mod:`.min_scale`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._policies.base import GradStats, LossScalePolicy, check_policy
from optax_dls._policies.min_scale import skips_at_min_scale
from optax_dls._util import validation as _validation


class FallbackState(NamedTuple):
  """Policy state of :func:`fp32_fallback`.

  Attributes:
    policy_state: a ``SkipsAtMinScaleState``: the wrapped policy's state
      (``policy_state``) and the consecutive skips taken at its minimum scale
      (``skips_at_min_scale``, int32 ``()``).
    fp32_fallback: bool ``()``. True while the loss should run in float32.
    steps_left: int32 ``()``. Updates left before the fallback ends (0 when off).
    consecutive_skips: int32 ``()``. Skipped steps since the last applied one.
  """

  policy_state: Any
  fp32_fallback: jax.Array
  steps_left: jax.Array
  consecutive_skips: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    return {"fp32_fallback": self.fp32_fallback}


def fp32_fallback(
  policy: LossScalePolicy,
  *,
  after: int = 10,
  steps: int = 100,
  scale: float | None = None,
) -> LossScalePolicy:
  """Wraps ``policy`` with a float32 fallback for when float16 keeps failing.

  When a skipped step makes ``after`` consecutive skips, the state's
  ``fp32_fallback`` flag turns on for the next ``steps`` updates, during which
  the training step computes the loss in float32; the wrapped policy keeps
  moving the scale meanwhile. On the update that ends it, the scale restarts at
  ``scale`` and the wrapped policy's state at its initial value.
  :func:`metrics` reports the flag as ``fp32_fallback``; the step picks the
  computation with it inside the compiled step (both branches traced once, so
  switching never recompiles; they must return the same structure, shapes and
  dtypes)::

      loss = jax.lax.cond(
        optax_dls.metrics(opt_state)["fp32_fallback"], fp32_loss, fp16_loss, params, batch
      )

  It also counts the consecutive skips taken while the scale was already at
  the policy's ``min_scale``: such an overflow cannot be cured by backing off
  (the data, the learning rate or the forward pass is at fault, or float16
  itself). :func:`metrics` reports the count as ``skips_at_min_scale`` (reset
  by an applied step, and when the fallback ends); :class:`SkipAlerts` warns
  on the first one.

  Args:
    policy: the :class:`LossScalePolicy` to wrap, e.g. :func:`dynamic_policy`;
      its ``min_scale`` is the floor the count compares with.
    after: int in [1, 2**31 - 1], consecutive skipped steps that start the
      fallback. Default 10.
    steps: int in [1, 2**31 - 1], updates the fallback lasts. Default 100.
    scale: float in the policy's ``[min_scale, max_scale]``, or None (the
      default: the policy's initial scale), the scale to restart at.

  Returns:
    A :class:`LossScalePolicy` whose state is a ``FallbackState``
    (``optax_dls._policies.fallback``): the wrapped policy's
    state and the skips at the minimum scale (``policy_state``, a
    ``SkipsAtMinScaleState`` of ``policy_state`` and ``skips_at_min_scale``,
    int32 ``()``), the flag (``fp32_fallback``, bool ``()``), the updates left
    (``steps_left``) and the skips in a row (``consecutive_skips``), both int32
    ``()``.

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`, one of its fields
      has the wrong type (see :class:`LossScalePolicy`), or a wrong or traced
      value.
    ValueError: a value out of range, ``scale`` included (the message names
      it), or ``policy``'s ``stats``, scale range or initial scale is not valid.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(min_scale=2.0**15), after=2)
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
