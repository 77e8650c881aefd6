"""The loss times the loss scale: what a user differentiates."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from optax_dls._access.find import find_state
from optax_dls._util import frames as _frames


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """Multiplies ``loss`` by the current loss scale S, before differentiation.

  Args:
    loss: a floating array of any shape (usually the scalar loss, float32); bfloat16 and float16 are
      promoted to float32. A float16 loss warns: its backward pass starts at S in float16, inf from
      S = 2**16; reduce in float32 instead.
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Returns:
    ``loss * S`` with dtype ``promote_types(loss.dtype, float32)``.

  Raises:
    TypeError: ``loss`` is not a floating-point array (e.g. an int, a str or None).
    ValueError: none or more than one loss-scale state in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> optax_dls.scale_loss(jnp.bfloat16(0.5), state)
    Array(512., dtype=float32)
  """
  return times_scale(loss, find_state(opt_state).loss_scale)


def times_scale(loss: Any, scale: jax.Array) -> jax.Array:
  """``loss * scale`` in ``promote_types(loss.dtype, float32)``; TypeError unless floating."""
  if loss is None or isinstance(loss, (str, bytes)):
    raise TypeError(
      f"loss must be a floating-point array, got {loss!r} of type {type(loss).__name__}."
    )
  if isinstance(loss, (tuple, list, dict)):
    raise TypeError(
      f"loss must be a floating-point array, got a {type(loss).__name__}: a function that "
      "returns (loss, aux) needs has_aux=True (value_and_grad), or pass the loss alone "
      "(scale_loss(loss, opt_state))."
    )
  try:
    loss = jnp.asarray(loss)
  except (TypeError, ValueError) as e:
    raise TypeError(
      f"loss must be a floating-point array, got {loss!r} of type {type(loss).__name__}: {e}"
    ) from None
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss must be a floating-point array, got dtype {loss.dtype}.")
  if loss.dtype == jnp.float16:
    warnings.warn(
      "optax_dls: the loss is float16: differentiating loss * S starts the backward pass at S "
      "in float16, which is inf once S reaches 2**16 (a dynamic scale grows toward its "
      "max_scale, 2**24 by default), and every step at such a scale overflows and is skipped. "
      "Compute the loss in float32: cast the per-example values before the reduction "
      "(jnp.mean(per_example.astype(jnp.float32))), or reduce in float32 with "
      "optax_dls.full_precision(jnp.mean, output_dtype=jnp.float32)(per_example). A float16 "
      "loss cast to float32 after its reduction silences this and keeps the overflow.",
      UserWarning,
      stacklevel=_frames.user_stacklevel(),
    )
  dtype = jnp.promote_types(loss.dtype, jnp.float32)
  return loss.astype(dtype) * scale.astype(dtype)
