"""Numerics of loss scaling: the exact all-finite check, unscaling, gradient statistics."""

from __future__ import annotations

import functools
from collections.abc import Callable
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
  """float32 (complex64), or the leaf's own dtype where that is wider
  (float64 / complex128 under x64); float8 and other narrow floats too."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype
  return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def _as(x: Any, dtype: Any) -> jax.Array:
  """``x`` in ``dtype``, strongly typed (``x.astype(dtype)``, one primitive)."""
  return lax.convert_element_type(x, dtype)


def _abs2(x: jax.Array) -> jax.Array:
  """``|x|**2`` entry by entry, in ``x``'s real dtype. A complex leaf as ``real(x *
  conj(x))``: XLA's CPU backend fuses that into the sum, where ``real(x)**2 + imag(x)**2``
  writes each part out."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.real(x * jnp.conj(x))
  return lax.mul(x, x)


def _total(x: jax.Array) -> jax.Array:
  """The sum of every entry of ``x``, a ``()``."""
  return lax.reduce_sum(x, tuple(range(x.ndim)))


def _top(x: jax.Array) -> jax.Array:
  """The largest entry of ``x`` (NaN if one is), a ``()``."""
  return lax.reduce_max(x, tuple(range(x.ndim)))


def _added(parts: list[jax.Array]) -> jax.Array:
  """float32 ``()``: ``0 + parts[0] + parts[1] + ...`` in that order."""
  return functools.reduce(lax.add, parts, jnp.zeros([], jnp.float32))


# The per-leaf functions below use ``lax`` primitives rather than ``jnp``'s functions: a
# ``jnp`` function is traced once for each new leaf shape, several times the cost.


def all_finite(tree: Any, axis_name: _multi_device.AxisName = None) -> jax.Array:
  """Returns whether every floating-point entry of ``tree`` is finite.

  The check is exact: finite values of any size count as finite, and a single
  inf, -inf or NaN in any leaf of dtype bfloat16, float16, float32 or float64
  (or complex) makes the result False. Integer, bool and ``None`` leaves are
  ignored. No host synchronisation: the result stays on the device. Cost:
  one read of each leaf (a float32 sum of squares, which is finite only when
  every entry is); only when that sum is not finite, a second, entry-by-entry
  read in a ``lax.cond`` tells a non-finite entry from squares that overflow.
  NumPy float64 input is converted as JAX converts it: without
  ``jax_enable_x64`` it becomes float32 first, where values beyond about
  3.4e38 are inf.

  Args:
    tree: a pytree of arrays of any shapes and dtypes.
    axis_name: ``None`` (default), a mapped axis name, or a tuple of names.
      Under ``pmap`` or ``shard_map`` the flag is reduced over these axes, so
      every device gets the same answer. Leave ``None`` under ``jit`` with
      ``NamedSharding``, where the reduction is already global.

  Returns:
    A bool array of shape ``()``.

  Raises:
    TypeError: a leaf of ``tree`` that is not an array or number (e.g. a
      string), or an ``axis_name`` that is not None, a string or a tuple of
      strings.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_dls
    >>> bool(optax_dls.all_finite({'w': jnp.array([1e30, -2.0])}))
    True
    >>> bool(optax_dls.all_finite({'w': jnp.array([1.0, jnp.inf], jnp.float16)}))
    False
  """
  names = _multi_device.axis_names(_multi_device.check_axis_name(axis_name))
  _validation.arrays("tree", tree)
  # One plain read of each leaf decides the common case (a finite sum of
  # squares proves every entry finite); only a sum that is not finite pays
  # for the entry-by-entry check, in a cond.
  sq = sum_squares(tree, names)
  return lax.cond(
    jnp.isfinite(sq), lambda t: jnp.bool_(True), lambda t: exact_all_finite(t, names), tree
  )


def exact_all_finite(tree: Any, axis_name: _multi_device.AxisName = None) -> jax.Array:
  """bool ``()``: :func:`all_finite` always entry by entry (one read of each leaf, no cond)."""
  leaves = float_leaves(tree)
  amax = leaf_amax(leaves)
  bad = jnp.sum(leaf_codes(amax, jnp.float32(1.0)) > 0)
  return _multi_device.psum(bad, axis_name) == 0


def unscale(tree: Any, inv_scale: jax.typing.ArrayLike, params: Any = None) -> Any:
  """Multiplies each floating leaf by ``inv_scale`` in float32 (or wider); other leaves
  pass through unchanged.

  The product takes the leaf's own dtype, except where ``params`` has, at the leaf's
  place, a real floating parameter of a wider dtype than a real floating gradient (a
  float16 or bfloat16 gradient of a float32 parameter): it then takes the parameter's
  dtype, so that no value below the gradient dtype's smallest subnormal is flushed to
  zero again (a float16 gradient of 2**-30, scaled to 2**-15, comes back as 2**-30, not
  0). Where the parameter is as narrow as its gradient, where ``params`` is None, or
  where ``params`` does not have the structure of ``tree`` (``None`` gradient leaves
  match any parameter leaf), the gradient's own dtype is kept.
  """

  def one(x: Any) -> Any:
    if not is_float(x):
      return x
    dtype = jnp.result_type(x)  # a Python float's too
    ct = compute_dtype(dtype)
    return _as(lax.mul(_as(x, ct), _as(inv_scale, ct)), dtype)

  return jax.tree.map(one, widened(tree, params))


def widened(tree: Any, params: Any) -> Any:
  """``tree`` with each floating leaf in the dtype :func:`unscale` gives it (its parameter's,
  where wider): what the finite check reads, so that it decides on the values the inner
  optimizer will get (a float16 gradient of a float32 parameter unscaled by 1/S > 1 can
  pass 65504 and stay finite). ``tree`` itself where no leaf widens."""
  dtypes = _param_dtypes(tree, params)
  if all(d is None for d in dtypes):
    return tree
  leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
  cast = [x if d is None else x.astype(d) for x, d in zip(leaves, dtypes, strict=True)]
  return jax.tree.unflatten(treedef, cast)


def _param_dtypes(tree: Any, params: Any) -> list[Any]:
  """Per leaf of ``tree`` (``None`` leaves included): the dtype its unscaled value takes
  when wider than its own (see :func:`unscale`), else None."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
  if params is None:
    return [None] * len(leaves)
  try:
    matched = jax.tree.structure(tree, is_leaf=lambda x: x is None).flatten_up_to(params)  # type: ignore[attr-defined]
  except (ValueError, TypeError):
    return [None] * len(leaves)
  return [_wider(x, p) for x, p in zip(leaves, matched, strict=True)]


def _wider(grad: Any, param: Any) -> Any:
  """``param``'s dtype where both are real floating arrays and it is wider, else None."""
  if not (is_float(grad) and is_float(param)):
    return None
  g, p = jnp.dtype(jnp.result_type(grad)), jnp.dtype(jnp.result_type(param))
  real = jnp.floating
  if jnp.issubdtype(g, real) and jnp.issubdtype(p, real) and p.itemsize > g.itemsize:
    return p
  return None


def global_amax(tree: Any, axis_name: _multi_device.AxisName = None) -> jax.Array:
  """float32 ``()``: largest absolute value over every floating leaf (0 if none),
  maximised over ``axis_name`` when given."""
  amax = jnp.zeros([], jnp.float32)
  for x in float_leaves(tree):
    if x.size:
      amax = lax.max(amax, _as(_top(lax.abs(x)), jnp.float32))
  return _multi_device.pmax(amax, axis_name)


def sum_squares(tree: Any, axis_name: _multi_device.AxisName = None) -> jax.Array:
  """float32 ``()``: sum of ``|x|**2`` over every floating entry of ``tree``.

  One fused read of each leaf, squared and accumulated in float32 (float64
  for float64 leaves). The sum is inf or NaN when some entry is inf or
  NaN (squares are never negative, so nothing cancels), and +inf also when
  finite entries are large enough for their squares to overflow (beyond
  about 1.8e19 in float32). So a finite sum proves every entry finite;
  :func:`finite_and_norm` settles the rare non-finite sums exactly.

  With ``axis_name`` the sum is ``psum``-ed over those axes; a leaf replicated
  over a named axis (it does not vary over it) is divided by that axis' size
  first, so it is counted once (see :func:`finite_and_norm`).
  """
  parts = square_sums(float_leaves(tree), _multi_device.axis_sizes(axis_name))
  return _multi_device.psum(_added(parts), axis_name)


def square_sums(leaves: list[jax.Array], sizes: dict[str, int]) -> list[jax.Array]:
  """float32 ``()`` per leaf: the sum of ``|x|**2`` (one read), divided by the number of
  devices of the named axes (``sizes``) that hold the same copy of the leaf."""
  parts = []
  for leaf in leaves:
    part = _as(_total(_abs2(_as(leaf, compute_dtype(leaf.dtype)))), jnp.float32)
    copies = _multi_device.replicas(leaf, sizes)
    parts.append(part / copies if copies > 1 else part)
  return parts


def valid_scale(scale: jax.Array) -> jax.Array:
  """bool ``()``: whether ``scale`` can unscale, i.e. ``0 < 1/scale < inf``:
  False for a scale that is NaN, +-inf, 0, negative or so small that its
  inverse overflows float32."""
  inv = 1.0 / jnp.asarray(scale, jnp.float32)
  return (inv > 0) & (inv < jnp.inf)


def leaf_amax(leaves: list[jax.Array]) -> list[jax.Array]:
  """Each leaf's largest real or imaginary magnitude, a ``()`` of the leaf's real dtype
  (0 for an empty leaf): one read of the leaf. NaN when the leaf holds a NaN (``max``
  propagates it), +inf when it holds an infinity and no NaN, finite otherwise."""
  out = []
  for x in leaves:
    if not x.size:
      out.append(jnp.zeros([], jnp.real(x).dtype))
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
      out.append(lax.max(_top(lax.abs(lax.real(x))), _top(lax.abs(lax.imag(x)))))
    else:
      out.append(_top(lax.abs(x)))
  return out


def _per_dtype(values: list[jax.Array], fn: Callable[[Any, jax.Array], jax.Array]) -> jax.Array:
  """``[len(values)]``: ``fn(dtype, stacked)`` of the scalars of each dtype, stacked, back in
  the order of ``values``: a few operations, whatever their number."""
  by_dtype: dict[Any, list[int]] = {}
  for i, v in enumerate(values):
    by_dtype.setdefault(jnp.dtype(v.dtype), []).append(i)
  order: list[int] = []
  parts = []
  for dtype, idx in by_dtype.items():
    parts.append(fn(dtype, jnp.stack([values[i] for i in idx])))
    order += idx
  joined = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
  return joined if order == sorted(order) else joined[np.argsort(np.asarray(order))]


def _codes_by_dtype(values: list[jax.Array], k: jax.Array | None = None) -> jax.Array:
  """int32 ``[len(values)]``: 2 where a scalar is NaN, 1 where it is infinite, 0 otherwise,
  each told in its own dtype (a finite float64 value past the float32 range is finite),
  after unscaling by ``k`` (a float32 ``()`` >= 1) in that dtype if given. The scalars of
  one dtype are stacked and classified together."""
  if not values:
    return jnp.zeros([0], jnp.int32)

  return _per_dtype(values, lambda dtype, v: _classified(v, k))


def _classified(v: jax.Array, k: jax.Array | None = None) -> jax.Array:
  """int32, entry by entry: 2 where ``v`` (unscaled by ``k`` in its own dtype, if given) is
  NaN, 1 where it is infinite, 0 otherwise."""
  v = v if k is None else unscale(v, k)
  return jnp.where(jnp.isnan(v), 2, jnp.where(jnp.isinf(v), 1, 0)).astype(jnp.int32)


def _above_one(inv_scale: jax.Array) -> jax.Array:
  """float32 ``()``: ``inv_scale`` where it is above 1 (a loss scale below 1, where the
  unscaled values are checked themselves), else 1."""
  return jnp.where(inv_scale > 1, inv_scale, 1.0).astype(jnp.float32)


# Each entry times _TINY[compute dtype], squared: far from overflow for every finite
# entry of that dtype (float32: (2**128 * 2**-100)**2 = 2**56, and a sum of 2**31 of them
# 2**87; float64: (2**1024 * 2**-552)**2 = 2**944), so a sum of them is finite exactly when
# every entry is, and the norm of a leaf whose plain squares overflow loses nothing to the
# entries the factor flushes (float32: those below about 2**-37 in a norm above 2**64).
# The factor is applied before squaring: its square is not a float32 number.
_TINY = {jnp.dtype(jnp.float32): 2.0**-100, jnp.dtype(jnp.float64): 2.0**-552}
# The float32 value of the scaled squares' sum of a float64 leaf (times 2**-1104) is its
# own times this (times 2**-200, as a float32 leaf's).
_TO_FLOAT32 = {jnp.dtype(jnp.float32): 1.0, jnp.dtype(jnp.float64): 2.0 ** (1104 - 200)}


def _own_zero(x: jax.Array) -> jax.Array:
  """A zero ``()`` of ``x``'s real dtype computed from ``x``'s first entry (finite whatever
  it is).

  XLA's CPU backend fuses an elementwise producer into a reduction only when it reads the
  reduced array alone: a factor that is a constant or another array's scalar makes it write
  the product out, an array of the leaf's size. A factor computed from the leaf itself
  keeps the read fused (a factor computed entry by entry does not). The first entry is a
  static slice, not ``x.reshape(-1)[0]``: on a leaf sharded over ``Auto`` mesh axes the
  reshape made the compiler gather the whole leaf; the slice costs one element's
  broadcast. A leaf sharded over ``Explicit`` mesh axes gets a plain zero.

  The factor costs a kernel of its own per leaf: worth it for a large leaf, whose written
  product would be scratch memory of its size, not for a small one, whose written product
  (two small leaves' worth of scratch memory, reused leaf after leaf) compiles faster than
  the fused reduction.
  """
  real = jnp.real(x).dtype
  spec = getattr(getattr(_multi_device.typeof(x), "sharding", None), "spec", None)
  if spec is not None and any(p is not None for p in spec):
    return jnp.zeros([], real)
  first = jnp.real(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(()))
  return jnp.isnan(first).astype(real) * 0


# The exact path writes out the products of leaves up to this many entries (1 MiB of
# float32), a kernel fewer each to compile; a larger leaf's are fused into its read.
_WRITTEN_OUT_MAX = 2**18


def _fused_zero(x: jax.Array) -> jax.Array | None:
  """:func:`_own_zero` of ``x`` where a product with ``x`` must be fused into its read (a
  leaf of more than ``_WRITTEN_OUT_MAX`` entries); None where it may be written out."""
  return _own_zero(x) if x.size > _WRITTEN_OUT_MAX else None


def _factor(s: jax.Array, zero: jax.Array | None) -> jax.Array:
  """The scalar ``s`` as a factor of a read: plus ``zero`` (:func:`_fused_zero`) where given."""
  return s if zero is None else lax.add(s, zero)


def tiny_square_sums(leaves: list[jax.Array], k: jax.Array | None = None) -> list[jax.Array]:
  """Per leaf, the sum of ``|u * _TINY|**2`` in the leaf's compute dtype, one read, with
  ``u`` the leaf times ``k`` (a float32 ``()`` >= 1, default 1; the compute dtype's
  product, as :func:`unscale` forms it). Finite exactly when every entry of ``u`` is
  finite, NaN when one is NaN, +inf when one is infinite and none NaN; and, brought to
  float32 (:func:`tiny_norm`), the norm without overflow. For a leaf of more than
  ``_WRITTEN_OUT_MAX`` entries the factors are computed from the leaf (:func:`_own_zero`),
  so that XLA's CPU backend fuses the product into the read instead of writing it out; a
  smaller leaf's product is written out (at most a few MiB of scratch memory, and a
  faster compile)."""
  # The factor must not be a constant XLA can see: it would rewrite (x * t)**2 as
  # x**2 * t**2, and t**2 is not a float32 number (0: inf * 0 = NaN). A zero computed from
  # the leaf does not hide it: XLA's GPU backend folds it away.
  opaque: dict[Any, jax.Array] = {}
  out = []
  for leaf in leaves:
    ct = compute_dtype(leaf.dtype)
    real = jnp.dtype(jnp.finfo(ct).dtype)
    if not leaf.size:
      out.append(jnp.zeros([], real))
      continue
    x = _as(leaf, ct)
    zero = _fused_zero(x)
    if k is not None:
      x = lax.mul(x, _as(_factor(_as(k, real), zero), ct))
    if real not in opaque:
      opaque[real] = lax.optimization_barrier(jnp.asarray(_TINY[real], real))
    out.append(_total(_abs2(lax.mul(x, _as(_factor(opaque[real], zero), ct)))))
  return out


def _low_precision_overflow(leaves: list[jax.Array], k: jax.Array) -> jax.Array:
  """bool ``()``: whether unscaling by ``k`` (> 1) overflows a leaf of a dtype narrower
  than its compute dtype (float16, bfloat16): its largest product reaches the value that
  rounds to inf in the leaf's dtype. One read of each such leaf (written out as in
  :func:`tiny_square_sums`)."""
  bad = jnp.zeros([], jnp.bool_)
  for leaf in leaves:
    ct = compute_dtype(leaf.dtype)
    if jnp.dtype(leaf.dtype) == jnp.dtype(ct) or not leaf.size:
      continue
    x = _as(leaf, ct)
    factor = _factor(_as(k, jnp.finfo(ct).dtype), _fused_zero(x))
    top = leaf_amax([lax.mul(x, _as(factor, ct))])[0]
    bad = bad | ~jnp.isfinite(top.astype(leaf.dtype))  # rounds to the leaf's dtype as unscale
  return bad


def _stacked_float32(values: list[jax.Array], factor: dict | None = None) -> jax.Array:
  """float32 ``[n]`` of scalars of several dtypes, each stacked with its dtype and converted
  (times ``factor[dtype]``, if given)."""

  def converted(dtype: Any, v: jax.Array) -> jax.Array:
    if factor is not None and factor[dtype] != 1.0:
      v = v * jnp.asarray(factor[dtype], dtype)
    return v.astype(jnp.float32)

  return _per_dtype(values, converted)


def tiny_norm(
  leaves: list[jax.Array], tiny: list[jax.Array], inv_scale: jax.Array, axis_name: Any = None
) -> jax.Array:
  """float32 ``()``: the global L2 norm of ``leaves`` times ``inv_scale`` from their
  :func:`tiny_square_sums`, each counted once per replica, as in :func:`sum_squares`:
  inf only when the norm itself is past the float32 range."""
  if not leaves:
    return jnp.zeros([], jnp.float32)
  sizes = _multi_device.axis_sizes(axis_name)
  copies = jnp.asarray([_multi_device.replicas(x, sizes) for x in leaves], jnp.float32)
  scaled = {k: v for k, v in _TO_FLOAT32.items()}
  total = _multi_device.psum(jnp.sum(_stacked_float32(tiny, scaled) / copies), axis_name)
  # sqrt(total) * 2**100 * inv: no intermediate overflows or underflows unless the norm does.
  return jnp.sqrt(total) * 2.0**50 * inv_scale * 2.0**50


class Check(NamedTuple):
  """What the finite check learns about one step's scaled gradients.

  Attributes:
    finite: bool ``()``: the loss scale is valid and every floating entry of the
      unscaled gradients is finite (reduced over the named axes).
    grad_norm: float32 ``()``: the global L2 norm of the unscaled gradients in
      float32 (inf or NaN when an entry is not finite; finite when a float16 or
      bfloat16 entry overflows only once unscaled below a scale of 1, as the
      step's float32 norm is).
    nonfinite: bool ``[n]``: one flag per floating gradient leaf (``n`` of them, in
      ``jax.tree.leaves`` order), set where the leaf is not finite (all clear on a
      finite step).
    nan: bool ``[n]``: set where the leaf holds a NaN.
    amax: float32 ``()``, the largest magnitude of the scaled gradients (reduced over
      the named axes), where the check's own reads give it; None otherwise.
  """

  finite: jax.Array
  grad_norm: jax.Array
  nonfinite: jax.Array
  nan: jax.Array
  amax: jax.Array | None = None


def _check(
  codes: jax.Array, valid: jax.Array, norm: jax.Array, axis_name: _multi_device.AxisName
) -> Check:
  """The :class:`Check` of per-leaf ``codes`` (0 finite, 1 inf, 2 NaN), the same on every
  device of the named axes."""
  codes = _multi_device.pmax(codes, axis_name)
  finite = valid & ~jnp.any(codes > 0)
  return Check(finite, norm, codes > 0, codes == 2)


def leaf_codes(amax: list[jax.Array], inv_scale: jax.Array) -> jax.Array:
  """int32 ``[len(amax)]`` from each leaf's largest magnitude (:func:`leaf_amax` of the
  *scaled* leaf): 0 when every entry of the unscaled leaf is finite, 1 when one is
  infinite (and none NaN), 2 when one is NaN. Exact: with a loss scale of at least 1
  unscaling only shrinks values; below 1, rounding is monotone, so the largest
  magnitude is the first entry to overflow when unscaled, in the leaf's own dtype."""
  if not amax:
    return jnp.zeros([0], jnp.int32)
  return _codes_by_dtype(amax, _above_one(inv_scale))


def finite_and_norm(
  grads: Any, scale: jax.Array, axis_name: _multi_device.AxisName = None, want_amax: bool = False
) -> Check:
  """The check of ``u = unscale(grads, 1/scale)``, for the CPU: a :class:`Check`.

  The common case is one read of each gradient leaf: :func:`sum_squares` of the
  *scaled* gradients is finite only when every entry is, and with a loss scale of
  at least 1, ``|u| <= |grads|`` entry by entry (rounding is monotone), so ``u`` is
  finite too; ``u`` is never materialised. Anything else takes an exact path in a
  ``lax.cond`` that runs only then: a sum of squares that is not finite (a
  non-finite entry, or finite entries whose squares overflow), or a loss scale
  below 1, where unscaling can overflow a finite gradient (a float16 leaf past
  65504). The exact path reads each leaf once more for the sum of its squares
  times 2**-100 (:func:`tiny_square_sums`: finite exactly when every entry is, NaN
  when one is NaN; it tells each leaf finite, holding an inf, or holding a NaN, and
  gives the norm without overflow); a float16 or bfloat16 leaf below a scale of 1
  is read once more, for its largest magnitude once unscaled. For float32 leaves
  the common path writes nothing of a leaf's size, and the exact path writes out
  the products of the leaves of at most 2**18 entries before summing them (on the
  CPU, a few MiB of scratch memory at most, reused leaf after leaf): fewer kernels
  to compile than a read that fuses the product, as a larger leaf's does. (XLA's
  CPU backend writes out the float32 squares of float16, bfloat16 and complex
  leaves on either path.)

  The norm is ``sqrt(sum_squares(grads)) / scale``, or, when the squares overflow
  float32, :func:`tiny_norm`; inf or NaN when some entry is not finite or the
  scale is not valid. Without ``axis_name`` it is local. With it, the norm is that
  of the whole gradient as the devices hold it together: a leaf that varies over a
  named axis (``shard_map(check_vma=True)`` types say so) is taken to be sharded
  along it, so its squared norms are summed over that axis; over a named axis along
  which it does not vary it is replicated and counted once. Where JAX does not
  track variance (``pmap``, ``check_vma=False``) every leaf is taken to be
  replicated and the squared norm is averaged over the named axes: exact for
  data-parallel (all-reduced) gradients, and the same value on every device in
  every case. The per-leaf bits are the same on every device. With ``want_amax``, the
  :class:`Check` holds the largest magnitude too (:func:`global_amax`, one more read).
  """
  valid = valid_scale(scale)
  inv = jnp.where(valid, 1.0 / jnp.asarray(scale, jnp.float32), jnp.nan)
  leaves = float_leaves(grads)
  sq = sum_squares(grads, axis_name)
  fast = jnp.isfinite(sq) & (inv <= 1)

  def quick(g: list[jax.Array], i: jax.Array, s: jax.Array) -> Check:
    clear = jnp.zeros([len(g)], jnp.bool_)
    return Check(jnp.bool_(True), jnp.sqrt(s) * i, clear, clear)

  def exact(g: list[jax.Array], i: jax.Array, s: jax.Array) -> Check:
    k = _above_one(i)  # a loss scale below 1: check u itself
    tiny = tiny_square_sums(g, k)
    codes = _codes_by_dtype(tiny)
    norm = jnp.where(jnp.isfinite(s), jnp.sqrt(s) * i, tiny_norm(g, tiny, i / k, axis_name))
    # Unscaling a float16 or bfloat16 leaf rounds it back to its dtype, where it overflows
    # before float32 does: its largest entry decides, read only for such leaves.
    low = [x for x in g if jnp.dtype(x.dtype) != jnp.dtype(compute_dtype(x.dtype))]
    if low:
      # The flag varies over the mesh axes the low-precision leaves vary over (shard_map).
      no = _multi_device.vary_like(jnp.zeros([], jnp.bool_), low[0])
      no = functools.reduce(_multi_device.vary_like, low[1:], no)
      overflow = lax.cond(i > 1, lambda: _low_precision_overflow(g, k), lambda: no)
      exact_codes = lambda: jnp.maximum(codes, leaf_codes(leaf_amax(g), i))
      codes = lax.cond(overflow, exact_codes, lambda: codes)
    return _check(codes, jnp.bool_(True), norm, axis_name)

  check = lax.cond(fast, quick, exact, leaves, inv, sq)
  top = global_amax(grads, axis_name) if want_amax else None  # one more read
  return check._replace(finite=check.finite & valid, amax=top)


def _reads(x: jax.Array, opaque: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One read of leaf ``x`` (non-empty), a single variadic reduction (one kernel on a GPU,
  whatever else reads the leaf), each result a ``()`` of the compute dtype's real type:
  the sum of ``|x|**2``; the sum of ``|x * _TINY|**2`` (``opaque`` is that factor), as in
  :func:`tiny_square_sums`: finite exactly when every entry is, NaN when one is NaN; and
  the largest real or imaginary magnitude."""
  ct = compute_dtype(x.dtype)
  real = jnp.finfo(ct).dtype
  x = _as(x, ct)
  if jnp.issubdtype(ct, jnp.complexfloating):
    top = lax.max(lax.abs(lax.real(x)), lax.abs(lax.imag(x)))
  else:
    top = lax.abs(x)
  operands = (_abs2(x), _abs2(lax.mul(x, _as(opaque, ct))), top)
  zero = jnp.zeros([], real)

  def combine(a: tuple, b: tuple) -> tuple:
    return lax.add(a[0], b[0]), lax.add(a[1], b[1]), lax.max(a[2], b[2])

  return tuple(lax.reduce(operands, (zero, zero, zero), combine, tuple(range(x.ndim))))


def finite_and_norm_fused(
  grads: Any, scale: jax.Array, axis_name: _multi_device.AxisName = None, want_amax: bool = False
) -> Check:
  """:func:`finite_and_norm` with no conditional, for GPUs and TPUs: one read of each
  leaf, so no predicate has to reach the host.

  Per leaf, one variadic reduction (a single kernel on a GPU) gives the sum of
  ``|x|**2``, the sum of the squares of ``x * 2**-100`` (:func:`tiny_square_sums`:
  finite exactly when every entry is, where the plain squares can overflow) and the
  largest magnitude, which decides exactly whether unscaling overflows the leaf's dtype
  at a scale below 1 (:func:`leaf_codes`). The per-leaf results are joined into one
  vector, and the flag, the bits and the norm are arithmetic on it. Everything the check
  reads feeds the finite flag, and every parameter-sized operation of the step waits for
  the flag, so XLA cannot merge the optimizer's elementwise work into these reductions.
  The flag and the bits equal those of :func:`finite_and_norm`; the norm equals it when
  the squares do not overflow, and is within float32 rounding of it otherwise. With
  ``want_amax``, the :class:`Check` holds the largest magnitude of the scaled gradients
  too (:func:`global_amax`), from the same reads where no leaf is complex.
  """
  valid = valid_scale(scale)
  inv = jnp.where(valid, 1.0 / jnp.asarray(scale, jnp.float32), jnp.nan)
  leaves = float_leaves(grads)
  if not leaves:
    norm = jnp.zeros([], jnp.float32)
    amax = jnp.zeros([], jnp.float32) if want_amax else None
    return _check(jnp.zeros([0], jnp.int32), valid, norm, axis_name)._replace(amax=amax)
  opaque: dict[Any, jax.Array] = {}  # see tiny_square_sums: XLA must not square the factor
  sq, tiny, tops = [], [], []
  for x in leaves:
    real = jnp.dtype(jnp.finfo(compute_dtype(x.dtype)).dtype)
    if x.size:
      if real not in opaque:
        opaque[real] = lax.optimization_barrier(jnp.asarray(_TINY[real], real))
      reads = _reads(x, opaque[real])
    else:
      reads = (jnp.zeros([], real),) * 3
    sq.append(_as(reads[0], jnp.float32))
    # (A float64 leaf's tiny sum, brought to float32's scale, can pass float32's range with
    # finite entries: the codes come from the largest magnitudes, in each leaf's dtype.)
    tiny.append(_as(lax.mul(reads[1], jnp.asarray(_TO_FLOAT32[real], real)), jnp.float32))
    tops.append(_as(reads[2], jnp.real(x).dtype))  # exact: a maximum of the leaf's entries
  # One vector of every leaf's results, behind a barrier: every later use reads it (XLA
  # would otherwise rewrite each sum over it as sums over the leaves' results again).
  n = len(leaves)
  if all(jnp.dtype(t.dtype) == jnp.float32 for t in tops):
    sq_v, tiny_v, top_v = lax.optimization_barrier(jnp.stack(sq + tiny + tops)).reshape(3, n)
    codes = _classified(top_v, _above_one(inv))  # leaf_codes' rule, on the vector
  else:  # other dtypes: each leaf's magnitude told in its own dtype
    sq_v, tiny_v = lax.optimization_barrier(jnp.stack(sq + tiny)).reshape(2, n)
    codes = leaf_codes(tops, inv)
  sizes = _multi_device.axis_sizes(axis_name)
  copies = np.asarray([_multi_device.replicas(x, sizes) for x in leaves], np.float32)
  names = _multi_device.axis_names(axis_name)
  total = _multi_device.psum(jnp.sum(sq_v / copies), names)
  tiny_total = _multi_device.psum(jnp.sum(tiny_v / copies), names)
  # sqrt(tiny_total) * 2**100 * inv: no intermediate overflows unless the norm does.
  norm = jnp.where(
    jnp.isfinite(total), jnp.sqrt(total) * inv, jnp.sqrt(tiny_total) * 2.0**50 * inv * 2.0**50
  )
  # A NaN shows in its leaf's sums whatever the reduction's order; a maximum may drop it.
  codes = jnp.where(jnp.isnan(sq_v) | jnp.isnan(tiny_v), 2, codes).astype(jnp.int32)
  check = _check(codes, valid, norm, axis_name)
  if not want_amax:
    return check
  if any(jnp.issubdtype(x.dtype, jnp.complexfloating) for x in leaves):  # |x|, not re or im
    return check._replace(amax=global_amax(grads, axis_name))
  top = functools.reduce(lax.max, [_as(t, jnp.float32) for t in tops])
  return check._replace(amax=_multi_device.pmax(top, axis_name))
