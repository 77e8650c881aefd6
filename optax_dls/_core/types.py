"""Matching one value's type to another's: dtype, weak type, and the mesh axes it varies over.

A skipped step must return exactly the types the applied step returns, so that
both branches of the skip agree and the state's types never change from one
step to the next (no retrace, and a ``lax.scan`` carry keeps its type).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_dls._core import multi_device as _multi_device


def strong(x: Any) -> Any:
  """``x`` strongly typed (same dtype and value): a weakly typed array becomes an ordinary
  one. Leaves that are not arrays (``None``, PRNG key data of extended dtypes) pass through."""
  if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.number):
    return x
  return lax.convert_element_type(x, x.dtype) if jax.typeof(x).weak_type else x


def weak(x: Any) -> bool:
  """Whether ``x`` (an array, a tracer, a ``jax.ShapeDtypeStruct`` or an abstract value)
  is weakly typed; a Python number is (a Python bool is not)."""
  if isinstance(x, (int, float, complex)):
    return not isinstance(x, bool)
  if isinstance(x, jax.Array):
    return bool(jax.typeof(x).weak_type)
  return bool(getattr(x, "weak_type", False))


def like(x: Any, target: Any) -> Any:
  """``x`` given ``target``'s dtype, ``Explicit`` sharding and the mesh axes it varies
  over: an old value of the inner state made to match what the inner update returns (it
  may widen a dtype, e.g. float16 moments to float32, or take the gradients' sharding).
  Weakly typed only where both ``x`` and ``target`` are."""
  if not hasattr(x, "dtype") or not hasattr(target, "dtype"):
    return x
  x = x if x.dtype == target.dtype else x.astype(target.dtype)
  x = x if weak(target) else strong(x)
  return _multi_device.vary_like(_multi_device.shard_like(x, target), target)


def as_weak_as(new: Any, old: Any) -> Any:
  """``new`` weakly typed only where ``old`` is too: a new value of the inner state never
  becomes weakly typed where ``init`` gave the leaf a strong type."""
  return new if weak(old) else strong(new)


def select(pred: jax.Array, new: Any, old: Any) -> Any:
  """``jnp.where(pred, new, old)`` for a bool ``()`` ``pred``: one ``lax.select_n`` where
  ``new`` and ``old`` are arrays of one shape, dtype and weak type (``jnp.where`` is traced
  once for each new shape, several times the cost), ``jnp.where`` otherwise."""
  if (
    isinstance(new, jax.Array)
    and isinstance(old, jax.Array)
    and new.shape == old.shape
    and new.dtype == old.dtype
    and weak(new) == weak(old)
  ):
    return lax.select_n(pred, old, new)
  return jnp.where(pred, new, old)


def negative_zeros_like(target: Any) -> Any:
  """``-0.0`` of ``target``'s type: shape, dtype, sharding (``Explicit`` mesh axes included)
  and the mesh axes it varies over; plain zeros for integer and bool leaves.

  The updates of a skipped step: ``p + (-0.0)`` is ``p`` bit for bit for every ``p``,
  ``-0.0`` included, where ``p + 0.0`` turns ``-0.0`` into ``+0.0``."""
  zero = -0.0 if jnp.issubdtype(jnp.result_type(target), jnp.inexact) else 0
  return _multi_device.vary_like(lax.full_like(target, zero), target)
