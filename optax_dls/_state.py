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
      last step (inf or NaN on a non-finite step; NaN before the first step);
      under ``pmap`` / ``shard_map`` with ``axis_name``, the norm over every
      device and the same on each (see ``docs/multi_device.md``).
    policy_state: pytree of the loss-scale policy (for the dynamic policy a
      :class:`DynamicScaleState`).
    inner_state: the wrapped optax transformation's state; bit-for-bit
      unchanged by a skipped step.
    skips_at_min_scale: int32 ``()``. Consecutive skipped steps taken while
      the scale was already at the policy's ``min_scale`` (0 when the wrapper
      was not told a ``min_scale``). Saturating.
    fp32_fallback: bool ``()``. True while the float32 fallback is on: the
      loss should be computed in float32 (see :func:`select_precision`).
    fallback_steps_left: int32 ``()``. Updates left before the fallback ends
      and the scale is reset (0 when the fallback is off).
    underflow: dict of float32 ``()`` fractions of the last step's unscaled
      gradients, ``{'zero_frac', 'subnormal_frac'}`` plus one such dict per
      parameter label; an empty dict unless ``underflow_stats`` is on.
  """

  loss_scale: jax.Array
  num_steps: jax.Array
  num_skipped: jax.Array
  consecutive_skips: jax.Array
  last_step_finite: jax.Array
  grad_norm: jax.Array
  policy_state: Any
  inner_state: Any
  skips_at_min_scale: jax.Array
  fp32_fallback: jax.Array
  fallback_steps_left: jax.Array
  underflow: Any


def init_state(loss_scale: jax.Array, policy_state: Any, inner_state: Any,
               underflow: Any = None) -> LossScaleState:
  """Builds the state before the first step, with every field at its fixed dtype.

  Each field is its own buffer, so the state can be donated to a jitted step.
  """
  return LossScaleState(
      loss_scale=jnp.array(loss_scale, jnp.float32),
      num_steps=jnp.zeros([], jnp.int32),
      num_skipped=jnp.zeros([], jnp.int32),
      consecutive_skips=jnp.zeros([], jnp.int32),
      last_step_finite=jnp.ones([], jnp.bool_),
      grad_norm=jnp.full([], jnp.nan, jnp.float32),
      policy_state=jax.tree.map(jnp.array, policy_state),
      inner_state=inner_state,
      skips_at_min_scale=jnp.zeros([], jnp.int32),
      fp32_fallback=jnp.zeros([], jnp.bool_),
      fallback_steps_left=jnp.zeros([], jnp.int32),
      underflow={} if underflow is None else underflow,
  )
