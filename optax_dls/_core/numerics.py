"""Numerics of loss scaling (Micikevicius et al. 2018, *Mixed Precision Training*): the
exact all-finite check, the gradient norm and unscaling, from one read of each leaf."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_dls._core import multi_device as _multi_device
from optax_dls._util import validation as _validation


def is_float(x: Any) -> bool:
  """Whether ``x`` is a floating or complex array or number (None, strings, functions
  and other objects are not: an Equinox model's activation functions have no dtype)."""
  if not (hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex))):
    return False
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def float_leaves(tree: Any) -> list[jax.Array]:
  """The floating and complex leaves of ``tree``, as arrays."""
  return [jnp.asarray(x) for x in jax.tree.leaves(tree) if is_float(x)]


def compute_dtype(dtype: Any) -> Any:
  """float32 (complex64), or the leaf's own dtype where that is wider (float64 /
  complex128 under x64)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating) or dtype.itemsize >= 4:
    return dtype
  return jnp.dtype(jnp.float32)


def _as(x: Any, dtype: Any) -> jax.Array:
  return lax.convert_element_type(x, dtype)


def unscale(tree: Any, inv_scale: jax.typing.ArrayLike, params: Any = None) -> Any:
  """Each floating leaf times ``inv_scale`` in float32 (or wider), in the leaf's dtype or
  its wider real parameter's (:func:`widened`); other leaves pass through unchanged."""

  def one(x: Any) -> Any:
    if not is_float(x):
      return x
    ct = compute_dtype(jnp.result_type(x))  # a Python float's too
    return _as(lax.mul(_as(x, ct), _as(inv_scale, ct)), jnp.result_type(x))

  return jax.tree.map(one, widened(tree, params))


def widened(tree: Any, params: Any) -> Any:
  """``tree`` with each real floating leaf in its parameter's dtype where that is a wider
  real float (what :func:`unscale` gives it); ``tree`` itself where ``params`` is None or
  does not have its structure."""
  real = lambda x: is_float(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)
  size = lambda x: jnp.dtype(jnp.result_type(x)).itemsize
  wide = lambda g, p: g.astype(p.dtype) if real(g) and real(p) and size(p) > size(g) else g
  try:
    none = lambda x: x is None
    return tree if params is None else jax.tree.map(wide, tree, params, is_leaf=none)
  except (ValueError, TypeError):  # params of another structure
    return tree


def valid_scale(scale: jax.Array) -> jax.Array:
  """bool ``()``: whether ``0 < 1/scale < inf`` (False for NaN, inf, 0, negative)."""
  inv = 1.0 / jnp.asarray(scale, jnp.float32)
  return (inv > 0) & (inv < jnp.inf)


class Check(NamedTuple):
  """What the check learns about one step's scaled gradients.

  Attributes:
    finite: bool ``()``: the scale is valid and every floating entry of the unscaled
      gradients is finite (reduced over the named axes).
    grad_norm: float32 ``()``: the global L2 norm of the unscaled gradients (inf or NaN
      when an entry is not finite).
    codes: uint8 ``[n]``, one per floating gradient leaf in ``jax.tree.leaves`` order:
      0 finite, 1 holds an infinity (once unscaled), 2 holds a NaN.
    amax: float32 ``()``, the largest magnitude (real or imaginary part) of the scaled
      gradients, or None.
  """

  finite: jax.Array
  grad_norm: jax.Array
  codes: jax.Array
  amax: jax.Array | None = None


# Each entry times _TINY[dtype], squared, is far from overflow for every finite entry
# (float32: (2**128 * 2**-100)**2 = 2**56), so their sum is finite exactly when every entry
# is; _TO_FLOAT32 brings a float64 leaf's sum to float32's scale (2**-200, as float32's).
_TINY = {jnp.dtype(jnp.float32): 2.0**-100, jnp.dtype(jnp.float64): 2.0**-552}
_TO_FLOAT32 = {jnp.dtype(jnp.float32): 1.0, jnp.dtype(jnp.float64): 2.0 ** (1104 - 200)}


def _reads(x: jax.Array, tiny: jax.Array, fused: bool) -> tuple[jax.Array, ...]:
  """The reads of leaf ``x``, in its real compute dtype: the sum of ``|x|**2``, the sum of
  ``|x * tiny|**2`` and the largest real or imaginary magnitude; one variadic reduction when
  ``fused``, else three plain ones (which XLA all-reduces across a mesh; XLA drops those
  whose results are not used). A complex leaf is read as its two real parts (a complex
  product would make ``inf * 0`` a NaN)."""
  x = _as(x, compute_dtype(x.dtype))
  parts = [lax.real(x), lax.imag(x)] if jnp.iscomplexobj(x) else [x]
  t = _as(tiny, parts[0].dtype)
  squares = lambda vs: functools.reduce(lax.add, [lax.mul(v, v) for v in vs])
  top = functools.reduce(lax.max, [lax.abs(v) for v in parts])
  operands = (squares(parts), squares([lax.mul(v, t) for v in parts]), top)
  combines, zero, dims = (lax.add, lax.add, lax.max), jnp.zeros([], t.dtype), tuple(range(x.ndim))
  if not fused:
    return tuple(lax.reduce(o, zero, f, dims) for o, f in zip(operands, combines, strict=True))
  combine = lambda a, b: tuple(f(u, v) for f, u, v in zip(combines, a, b, strict=True))
  return tuple(lax.reduce(operands, (zero,) * 3, combine, dims))


def check(
  grads: Any, scale: jax.Array, axis_name: Any = None, want_amax: bool = False, fused: bool = True
) -> Check:
  """The exact check of ``unscale(grads, 1/scale)``, without forming it: a :class:`Check`.

  Finite values of any size count as finite; an inf or NaN, an entry that unscaling by
  ``1/scale`` > 1 overflows in its own dtype, or a scale that is not valid makes the step
  non-finite. ``fused`` (GPUs, TPUs): one variadic reduction per leaf, no conditional.
  Otherwise (the CPU): each leaf's sum of squares decides, and only a sum that is not
  finite, or a scale below 1, takes the exact reads in a ``lax.cond``. With ``axis_name``
  the results are reduced over the named axes (a replicated leaf counted once).
  """
  valid = valid_scale(scale)
  inv = jnp.where(valid, 1.0 / jnp.asarray(scale, jnp.float32), jnp.nan)
  leaves = float_leaves(grads)  # an empty leaf reads as zeros: finite
  if not leaves:
    zero = jnp.zeros([], jnp.float32)
    return Check(valid, zero, jnp.zeros([0], jnp.uint8), zero if want_amax else None)
  reals = [jnp.dtype(jnp.finfo(compute_dtype(x.dtype)).dtype) for x in leaves]
  # The factor hidden from XLA, which would square it (inf * 0 = NaN).
  hidden = lambda r: lax.optimization_barrier(jnp.asarray(_TINY[r], r))
  tinies = {r: hidden(r) for r in dict.fromkeys(reals)}
  reads = lambda: [_reads(x, tinies[r], fused) for x, r in zip(leaves, reals, strict=True)]
  sq, tq, tops = (list(v) for v in zip(*reads()))
  if not fused:  # the CPU: the sums of squares decide, the rest only where they cannot
    # Finite sums and no scale below 1: no entry is inf or NaN and none overflows, so zeros
    # (varying as the sums do) stand in for the exact reads.
    quick = jnp.all(jnp.isfinite(jnp.stack([_as(v, jnp.float32) for v in sq]))) & (inv <= 1)
    exact = lambda _: tuple(list(v) for v in list(zip(*reads()))[1:])
    tq, tops = lax.cond(quick, lambda _: ([v * 0 for v in sq],) * 2, exact, None)
  # Every leaf's results in vectors behind a barrier: XLA keeps one reduction per leaf.
  to32 = [_as(v * jnp.asarray(_TO_FLOAT32[r], r), jnp.float32) for v, r in zip(tq, reals)]
  vectors, tops = lax.optimization_barrier(
    (jnp.stack([_as(v, jnp.float32) for v in sq] + to32), list(tops))
  )
  sq_v, tq_v = vectors.reshape(2, len(leaves))
  k = jnp.where(inv > 1, inv, 1.0)  # a scale below 1: the unscaled values are checked
  big = jnp.zeros([len(leaves)], jnp.bool_)
  # Each leaf in its own dtype, one vector per dtype (per leaf, XLA makes a kernel of each).
  for dtype in dict.fromkeys(jnp.real(x).dtype for x in leaves):
    at = np.asarray([i for i, x in enumerate(leaves) if jnp.real(x).dtype == dtype])
    top = jnp.stack([tops[i] for i in at])
    big = big.at[at].set(~jnp.isfinite(_as(top * _as(k, top.dtype), dtype)))
  codes = jnp.where(jnp.isnan(sq_v) | jnp.isnan(tq_v), 2, big.astype(jnp.int32))
  if axis_name is None:
    total, tiny_total = jnp.sum(sq_v), jnp.sum(tq_v)
  else:
    sizes = _multi_device.axis_sizes(axis_name)
    copies = np.asarray([_multi_device.replicas(x, sizes) for x in leaves], np.float32)
    total = _multi_device.psum(jnp.sum(sq_v / copies), axis_name)
    tiny_total = _multi_device.psum(jnp.sum(tq_v / copies), axis_name)
    codes = _multi_device.pmax(codes, axis_name)
  # sqrt(tiny_total) * 2**100 * inv: no intermediate overflows unless the norm does.
  norm = jnp.where(
    jnp.isfinite(total), jnp.sqrt(total) * inv, jnp.sqrt(tiny_total) * 2.0**50 * inv * 2.0**50
  )
  amax = None
  if want_amax:  # fused, the check's own largest magnitudes; the CPU's quick path has none
    tops = tops if fused else [_reads(x, tinies[r], False)[2] for x, r in zip(leaves, reals)]
    top = jnp.max(jnp.stack([_as(t, jnp.float32) for t in tops]))
    amax = top if axis_name is None else _multi_device.pmax(top, axis_name)
  return Check(valid & ~jnp.any(codes > 0), norm, codes.astype(jnp.uint8), amax)


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
  """Returns whether every floating-point entry of ``tree`` is finite.

  Exact: finite values of any size count as finite, and one inf, -inf or NaN in any
  floating or complex leaf makes the result False; integer, bool and ``None`` leaves are
  ignored. One read of each leaf, no host synchronisation. NumPy float64 input is
  converted as JAX converts it: without ``jax_enable_x64``, to float32 first.

  Args:
    tree: a pytree of arrays of any shapes and dtypes.
    axis_name: ``None`` (default), a mapped axis name, or a tuple of names: under
      ``pmap`` or ``shard_map`` the flag is reduced over them (``None`` under ``jit``
      with ``NamedSharding``, where the reduction is global already).

  Returns:
    A bool array of shape ``()``.

  Raises:
    TypeError: a leaf of ``tree`` is not an array or number (a string, say), or
      ``axis_name`` is not None, a string or a tuple of strings.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_dls
    >>> bool(optax_dls.all_finite({'w': jnp.array([1e30, -2.0])}))
    True
    >>> bool(optax_dls.all_finite({'w': jnp.array([1.0, jnp.inf], jnp.float16)}))
    False
  """
  axis_name = _multi_device.check_axis_name(axis_name)
  _validation.arrays("tree", tree)
  return check(tree, jnp.float32(1.0), axis_name).finite
