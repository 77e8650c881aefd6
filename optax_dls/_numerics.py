"""Numerics of loss scaling: the exact all-finite check, unscaling, gradient statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

AxisName = str | Sequence[str] | None


def _is_float(x: Any) -> bool:
  return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _float_leaves(tree: Any) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if _is_float(x)]


def _compute_dtype(dtype: Any) -> Any:
  """float32, or the leaf's own dtype where that is wider (float64 under x64)."""
  return jnp.promote_types(dtype, jnp.float32)


def _axis_names(axis_name: AxisName) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  if isinstance(axis_name, str):
    return (axis_name,)
  return tuple(axis_name)


def nonfinite_sum(tree: Any) -> jax.Array:
  """float32 ``()``: 0 when every floating leaf is finite, NaN otherwise.

  Uses ``x * 0``, which is 0 for every finite ``x`` however large and NaN for
  inf, -inf and NaN: one fused read of each leaf, exact in every dtype.
  """
  total = jnp.zeros([], jnp.float32)
  for x in _float_leaves(tree):
    total = total + jnp.sum(x * jnp.zeros([], x.dtype)).astype(jnp.float32)
  return total


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """Returns whether every floating-point entry of ``tree`` is finite.

  The check is exact: finite values of any size count as finite, and a single
  inf, -inf or NaN in any leaf of dtype bfloat16, float16, float32 or float64
  (or complex) makes the result False. Integer, bool and ``None`` leaves are
  ignored. No host synchronisation: the result stays on the device.

  Args:
    tree: a pytree of arrays of any shapes and dtypes.
    axis_name: ``None`` (default), a mapped axis name, or a tuple of names.
      Under ``pmap`` or ``shard_map`` the flag is reduced over these axes, so
      every device gets the same answer. Leave ``None`` under ``jit`` with
      ``NamedSharding``, where the reduction is already global.

  Returns:
    A bool array of shape ``()``.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_dls
    >>> bool(optax_dls.all_finite({'w': jnp.array([1e30, -2.0])}))
    True
    >>> bool(optax_dls.all_finite({'w': jnp.array([1.0, jnp.inf], jnp.float16)}))
    False
  """
  total = nonfinite_sum(tree)
  names = _axis_names(axis_name)
  if names:
    total = lax.psum(total, names)
  return jnp.isfinite(total)


def unscale(tree: Any, inv_scale: jax.Array) -> Any:
  """Multiplies each floating leaf by ``inv_scale`` in float32 (or wider) and
  casts back to the leaf's dtype; other leaves pass through unchanged."""

  def one(x):
    if not _is_float(x):
      return x
    ct = _compute_dtype(x.dtype)
    return (x.astype(ct) * inv_scale.astype(ct)).astype(x.dtype)

  return jax.tree.map(one, tree)


def global_norm(tree: Any) -> jax.Array:
  """float32 ``()``: L2 norm over every floating leaf, accumulated in float32."""
  sq = jnp.zeros([], jnp.float32)
  for x in _float_leaves(tree):
    x32 = x.astype(_compute_dtype(x.dtype))
    sq = sq + jnp.sum(jnp.real(x32 * jnp.conj(x32))).astype(jnp.float32)
  return jnp.sqrt(sq)


def global_amax(tree: Any) -> jax.Array:
  """float32 ``()``: largest absolute value over every floating leaf (0 if none)."""
  amax = jnp.zeros([], jnp.float32)
  for x in _float_leaves(tree):
    if x.size:
      amax = jnp.maximum(amax, jnp.max(jnp.abs(x)).astype(jnp.float32))
  return amax
