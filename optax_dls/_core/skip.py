"""The skip: a ``jnp.where`` selection or a ``lax.cond``, and matching one value's type to
another's (dtype, weak type, sharding, the mesh axes it varies over).

Both make the same decisions and leave a skipped step's state untouched bit for bit;
applied values agree to float32 rounding. ``"where"`` runs the inner update on zeros where
the step is not finite and keeps the old values with selections, which XLA's GPU backend
fuses into the optimizer's kernels; ``"cond"`` runs it only on a finite step (XLA's CPU
backend would copy the state for a selection). ``"auto"`` takes ``"cond"`` on the CPU and
``"where"`` elsewhere, by ``lax.platform_dependent`` (the platform lowered for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_dls._core import multi_device as _multi_device
from optax_dls._core import numerics as _numerics

LOWERINGS = ("auto", "cond", "where")


def check_lowering(lowering: Any) -> str:
  """``lowering`` if it is one of :data:`LOWERINGS`; TypeError / ValueError otherwise."""
  if not isinstance(lowering, str):
    raise TypeError(
      f"skip_lowering must be one of {LOWERINGS}, got {lowering!r} of type "
      f"{type(lowering).__name__}."
    )
  if lowering not in LOWERINGS:
    raise ValueError(f"skip_lowering must be one of {LOWERINGS}, got skip_lowering={lowering!r}.")
  return lowering


def check(lowering: str, grads: Any, scale: jax.Array, axis_name: Any, want_amax: bool) -> Any:
  """The check of ``lowering`` (:func:`optax_dls._core.numerics.check`): one fused read per
  leaf for ``"where"``, the read and a conditional exact path for ``"cond"``."""
  one = lambda fused: lambda g, s: _numerics.check(g, s, axis_name, want_amax, fused)
  if lowering == "auto":
    return lax.platform_dependent(grads, scale, cpu=one(False), default=one(True))
  return one(lowering == "where")(grads, scale)


def skipped(lowering: str, finite: jax.Array, apply: Callable, *ops: Any) -> Any:
  """``apply(grads, inner_state, params) -> (out, inner_state)`` where ``finite``, else
  ``(negative zeros like out, inner_state)`` in the types ``apply`` returns, lowered as
  ``lowering`` says."""
  if lowering == "auto":
    by = lambda lowered: lambda f, *o: lowered(f, apply, *o)
    return lax.platform_dependent(finite, *ops, cpu=by(by_cond), default=by(by_where))
  return (by_cond if lowering == "cond" else by_where)(finite, apply, *ops)


def by_cond(finite: jax.Array, apply: Callable, *ops: Any) -> Any:
  def skipped_step(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
    out, new_s = jax.eval_shape(apply, g, s, p)
    return jax.tree.map(negative_zeros_like, out), jax.tree.map(like, s, new_s)

  return lax.cond(finite, apply, skipped_step, *ops)


def by_where(finite: jax.Array, apply: Callable, grads: Any, inner_state: Any, params: Any) -> Any:
  # The same types on both sides: one select each (jnp.where would also broadcast).
  safe = jax.tree.map(lambda g: lax.select_n(finite, jnp.zeros_like(g), g), grads)
  out, new_s = apply(safe, inner_state, params)
  keep = lambda new, old: jnp.where(finite, new, like(old, new))
  out = jax.tree.map(lambda n: lax.select_n(finite, negative_zeros_like(n), n), out)
  return out, jax.tree.map(keep, new_s, inner_state)


def strong(x: Any) -> Any:
  """``x`` strongly typed (same dtype and value); other leaves pass through."""
  return lax.convert_element_type(x, x.dtype) if isinstance(x, jax.Array) and weak(x) else x


def weak(x: Any) -> bool:
  """Whether ``x`` (an array, a tracer, a ``jax.ShapeDtypeStruct``, an abstract value) is
  weakly typed; a Python number is (a Python bool is not)."""
  if isinstance(x, (int, float, complex)):
    return not isinstance(x, bool)
  return bool(getattr(jax.typeof(x) if isinstance(x, jax.Array) else x, "weak_type", False))


def like(x: Any, target: Any) -> Any:
  """``x`` given ``target``'s dtype, ``Explicit`` sharding and the mesh axes it varies over
  (an old inner state value made to match what the inner update returns: it may widen a
  dtype or take the gradients' sharding); weakly typed only where both are."""
  if not hasattr(x, "dtype") or not hasattr(target, "dtype"):
    return x
  x = x if x.dtype == target.dtype else x.astype(target.dtype)
  x = x if weak(target) else strong(x)
  return _multi_device.vary_like(_multi_device.shard_like(x, target), target)


def as_weak_as(new: Any, old: Any) -> Any:
  """``new`` weakly typed only where ``old`` is too."""
  return new if weak(old) else strong(new)


def negative_zeros_like(target: Any) -> Any:
  """``-0.0`` of ``target``'s type (plain zeros for integer and bool leaves): the updates of
  a skipped step, since ``p + (-0.0)`` is ``p`` bit for bit, ``-0.0`` included."""
  zero = -0.0 if jnp.issubdtype(jnp.result_type(target), jnp.inexact) else 0
  return _multi_device.vary_like(lax.full_like(target, zero), target)
