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

from optax_dls import _multi_device


def strong(x: Any) -> Any:
  """``x`` strongly typed (same dtype and value): a weakly typed array becomes an ordinary
  one. Leaves that are not arrays (``None``, PRNG key data of extended dtypes) pass through."""
  if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.number):
    return x
  return lax.convert_element_type(x, x.dtype) if jax.typeof(x).weak_type else x


def like(x: Any, target: Any) -> Any:
  """``x`` given ``target``'s dtype and the mesh axes it varies over: an old value of the
  inner state made to match what the inner update returns (it may widen a dtype, e.g.
  float16 moments to float32). Strongly typed where ``x`` is."""
  if not hasattr(x, "dtype") or not hasattr(target, "dtype"):
    return x
  x = x if x.dtype == target.dtype else x.astype(target.dtype)
  return _multi_device.vary_like(x, target)


def negative_zeros_like(target: Any) -> Any:
  """``-0.0`` of ``target``'s type: shape, dtype, sharding (``Explicit`` mesh axes included)
  and the mesh axes it varies over; plain zeros for integer and bool leaves.

  The updates of a skipped step: ``p + (-0.0)`` is ``p`` bit for bit for every ``p``,
  ``-0.0`` included, where ``p + 0.0`` turns ``-0.0`` into ``+0.0``."""
  zeros = jnp.zeros_like(target)
  if jnp.issubdtype(zeros.dtype, jnp.inexact):
    zeros = -zeros
  return _multi_device.vary_like(zeros, target)
