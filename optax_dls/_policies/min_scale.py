"""Counting skips at the minimum scale: the overflow is then not the loss scale's doing."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._policies.base import GradStats, LossScalePolicy, check_policy


class SkipsAtMinScaleState(NamedTuple):
  """Policy state of :func:`skips_at_min_scale`.

  Attributes:
    policy_state: the wrapped policy's state.
    skips_at_min_scale: int32 ``()``. Consecutive skipped steps taken while
      the scale was already at the policy's ``min_scale``. Saturating.
  """

  policy_state: Any
  skips_at_min_scale: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    return {"skips_at_min_scale": self.skips_at_min_scale}


def skips_at_min_scale(policy: LossScalePolicy) -> LossScalePolicy:
  """Wraps ``policy`` to count consecutive skips taken at its ``min_scale``.

  A step that overflows although the scale is already at its floor cannot be
  cured by backing off: the data, the learning rate or the forward pass is at
  fault (or float16 itself; see :func:`fp32_fallback`). :func:`metrics`
  reports the count as ``skips_at_min_scale``; :class:`SkipAlerts` warns on
  the first one. The scale itself is the wrapped policy's, unchanged.

  Args:
    policy: the :class:`LossScalePolicy` to wrap; its ``min_scale`` is the floor.

  Returns:
    A :class:`LossScalePolicy` whose state is a ``SkipsAtMinScaleState``: the
    wrapped policy's state (``policy_state``) and the count
    (``skips_at_min_scale``, int32 ``()``).

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`, or one of its fields
      has the wrong type (see :class:`LossScalePolicy`).
    ValueError: ``policy``'s ``stats``, scale range or initial scale is not valid.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> at_floor = optax_dls.dynamic_policy(init_scale=1.0, min_scale=1.0)
    >>> policy = optax_dls.skips_at_min_scale(at_floor)
    >>> tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
    >>> state = tx.init({'w': jnp.ones(1)})
    >>> _, state = tx.update({'w': jnp.array([jnp.nan])}, state)
    >>> int(optax_dls.metrics(state)['skips_at_min_scale'])
    1
  """
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
