"""The loss-scale state: one NamedTuple of fixed-dtype arrays around the inner state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
  """State of a loss-scaled optimizer, kept inside the optax ``opt_state``.

  Every field except ``policy_state`` and ``inner_state`` is a 0-d JAX array
  with the dtype given below, so the state flattens, jits, scans, shards
  (replicated) and checkpoints like any optax state. Hyperparameters are not
  stored here: they are static and closed over by the transformation.

  Attributes:
    loss_scale: float32 ``()``. The scale S to multiply the *next* loss by.
      Always finite and within ``[min_scale, max_scale]`` of the policy.
    num_steps: int32 ``()``. Number of ``update`` calls so far, skipped steps
      included. Saturates at ``2**31 - 1`` instead of wrapping.
    num_skipped: int32 ``()``. Number of skipped (non-finite) steps so far.
      Saturating.
    consecutive_skips: int32 ``()``. Skipped steps since the last applied
      step; reset to 0 by a finite step. Saturating.
    last_step_finite: bool ``()``. Whether the last step was applied (True
      before the first step).
    grad_norm: float32 ``()``. Global L2 norm of the unscaled gradients of the
      last step (inf or NaN on a non-finite step; NaN before the first step).
    policy_state: pytree of the loss-scale policy (for the dynamic policy a
      :class:`DynamicScaleState`).
    inner_state: the wrapped optax transformation's state; bit-for-bit
      unchanged by a skipped step.
  """

  loss_scale: jax.Array
  num_steps: jax.Array
  num_skipped: jax.Array
  consecutive_skips: jax.Array
  last_step_finite: jax.Array
  grad_norm: jax.Array
  policy_state: Any
  inner_state: Any


def init_state(loss_scale: jax.Array, policy_state: Any, inner_state: Any) -> LossScaleState:
  """Builds the state before the first step, with every field at its fixed dtype."""
  zero = jnp.zeros([], jnp.int32)
  return LossScaleState(
      loss_scale=jnp.asarray(loss_scale, jnp.float32),
      num_steps=zero,
      num_skipped=zero,
      consecutive_skips=zero,
      last_step_finite=jnp.ones([], jnp.bool_),
      grad_norm=jnp.full([], jnp.nan, jnp.float32),
      policy_state=policy_state,
      inner_state=inner_state,
  )
