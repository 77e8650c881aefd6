"""Counting skips at the minimum scale, which backing off cannot cure (for ``fp32_fallback``)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._policies.base import GradStats, LossScalePolicy, check_policy


class SkipsAtMinScaleState(NamedTuple):
  """Policy state of :func:`skips_at_min_scale`: the wrapped ``policy_state`` and
  ``skips_at_min_scale`` (int32 ``()``, saturating), consecutive skips at ``min_scale``."""

  policy_state: Any
  skips_at_min_scale: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    return {"skips_at_min_scale": self.skips_at_min_scale}


def skips_at_min_scale(policy: LossScalePolicy) -> LossScalePolicy:
  """Wraps ``policy`` to count consecutive skips at its ``min_scale``; the scale is the
  wrapped policy's. TypeError / ValueError as ``check_policy`` raises them."""
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
