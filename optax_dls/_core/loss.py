"""The loss of a step, checked once: as an array, whether it is finite (over the devices),
and whether the record says the step about to run had a loss that was not finite."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_dls._core import multi_device as _multi_device
from optax_dls._core.state import LossScaleState


def checked_loss(loss: Any) -> jax.Array | None:
  """``loss`` as an array (None stays None): a real floating-point array of any shape (the
  loss of this step, or its per-example values); TypeError naming it otherwise."""
  if loss is None:
    return None
  try:
    value = None if isinstance(loss, (str, bytes, dict)) else jnp.asarray(loss)
  except (TypeError, ValueError):
    value = None
  if value is None or not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
      f"loss must be None or a real floating-point array (the loss of this step), got "
      f"{loss!r} of type {type(loss).__name__}."
    )
  return value


def loss_not_finite(loss: Any, axis_name: Any) -> jax.Array:
  """bool ``()``: whether ``loss`` (an array, or None: not given) has an entry that is not
  finite, reduced over ``axis_name``."""
  if loss is None:
    return jnp.zeros([], jnp.bool_)
  bad = jnp.any(~jnp.isfinite(loss)).astype(jnp.int32)
  return _multi_device.pmax(bad, axis_name) > 0


def pending_loss(state: LossScaleState) -> jax.Array:
  """bool ``()``: whether the record says the loss of the step about to run was not finite
  (left by :func:`value_and_grad`, which checks the loss before ``update`` sees the
  gradients): that step is skipped as if the loss had been handed to ``update``."""
  record = state.nonfinite
  return record.loss & (record.step == optax.safe_increment(state.num_steps))
