"""The loss-scale state: one NamedTuple of fixed-dtype arrays around the inner state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LossScaleState(NamedTuple):
  """State of a loss-scaled optimizer, kept inside the optax ``opt_state``.

  Every field except ``policy_state`` and ``inner_state`` is a 0-d JAX array
  with the dtype given below, so the state flattens, jits, scans, shards
  (replicated) and checkpoints like any optax state. Hyperparameters are not
  stored here: they are static and closed over by the transformation, except
  the policy's scale range, which :func:`optax_dls.reset_scale` checks
  against.

  Attributes:
    loss_scale: float32 ``()``. The scale S to multiply the *next* loss by,
      kept within ``[min_scale, max_scale]`` (a NaN from a misbehaving policy
      stays NaN until the next step skips and restarts at the initial scale).
    min_scale: float32 ``()``. The policy's lowest scale.
    max_scale: float32 ``()``. The policy's highest scale.
    num_steps: int32 ``()``. Number of ``update`` calls so far, skipped steps
      included. Saturates at ``2**31 - 1`` instead of wrapping.
    num_skipped: int32 ``()``. Number of skipped (non-finite) steps so far.
      Saturating.
    consecutive_skips: int32 ``()``. Skipped steps since the last applied
      step; reset to 0 by a finite step. Saturating.
    last_step_finite: bool ``()``. Whether the last step was applied (True
      before the first step).
    recomputed_steps: int32 ``()``. Steps whose gradients :func:`optax_dls.value_and_grad`
      recomputed after an overflow. Saturating.
    recompute_tries: int32 ``()``. Extra forward and backward passes those
      recomputations took, the float32 last resort included. Saturating.
    grad_norm: float32 ``()``. Global L2 norm of the unscaled gradients of the
      last step (inf or NaN on a non-finite step; NaN before the first step);
      under ``pmap`` / ``shard_map`` with ``axis_name``, the norm over every
      device and the same on each (see ``docs/multi_device.md``).
    policy_state: pytree of the loss-scale policy (for the dynamic policy a
      ``DynamicScaleState`` of ``growth_tracker`` and ``hysteresis_left``).
    inner_state: the wrapped optax transformation's state; bit-for-bit
      unchanged by a skipped step.
  """

  loss_scale: jax.Array
  min_scale: jax.Array
  max_scale: jax.Array
  num_steps: jax.Array
  num_skipped: jax.Array
  consecutive_skips: jax.Array
  last_step_finite: jax.Array
  recomputed_steps: jax.Array
  recompute_tries: jax.Array
  grad_norm: jax.Array
  policy_state: Any
  inner_state: Any


def init_state(
  loss_scale: Any, scale_range: tuple[float, float], policy_state: Any, inner_state: Any
) -> LossScaleState:
  """Builds the state before the first step, with every field at its fixed dtype.

  Each field is its own buffer, so the state can be donated to a jitted step.
  """
  return LossScaleState(
    loss_scale=jnp.array(loss_scale, jnp.float32),
    min_scale=jnp.array(scale_range[0], jnp.float32),
    max_scale=jnp.array(scale_range[1], jnp.float32),
    num_steps=jnp.zeros([], jnp.int32),
    num_skipped=jnp.zeros([], jnp.int32),
    consecutive_skips=jnp.zeros([], jnp.int32),
    last_step_finite=jnp.ones([], jnp.bool_),
    recomputed_steps=jnp.zeros([], jnp.int32),
    recompute_tries=jnp.zeros([], jnp.int32),
    grad_norm=jnp.full([], jnp.nan, jnp.float32),
    policy_state=jax.tree.map(jnp.array, policy_state),
    inner_state=inner_state,
  )


def with_scale(state: LossScaleState, loss_scale: jax.Array, policy_state: Any) -> LossScaleState:
  """``state`` with a new scale (kept within ``[min_scale, max_scale]``) and policy state."""
  return state._replace(
    loss_scale=jnp.clip(jnp.asarray(loss_scale, jnp.float32), state.min_scale, state.max_scale),
    policy_state=policy_state,
  )


def advance(
  state: LossScaleState,
  finite: jax.Array,
  grad_norm: jax.Array,
  loss_scale: jax.Array,
  policy_state: Any,
  inner_state: Any,
) -> LossScaleState:
  """The state after one update: the new scale (kept in range), policy and inner
  states, and the step counters moved by whether the step was ``finite``."""
  return with_scale(state, loss_scale, policy_state)._replace(
    num_steps=optax.safe_increment(state.num_steps),
    num_skipped=jnp.where(finite, state.num_skipped, optax.safe_increment(state.num_skipped)),
    consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
    last_step_finite=finite,
    grad_norm=grad_norm,
    inner_state=inner_state,
  )
