"""Numerics of loss scaling: the exact all-finite check, unscaling, gradient statistics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_dls import _multi_device


def is_float(x: Any) -> bool:
  """Whether ``x`` is a floating or complex array (None and other leaves are not)."""
  return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


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


def nonfinite_sum(tree: Any) -> jax.Array:
  """float32 ``()``: 0 when every floating leaf is finite, NaN otherwise.

  Uses ``x - x``, which is 0 for every finite ``x`` however large and NaN for
  inf, -inf and NaN: one fused read of each leaf, exact in every dtype.
  """
  total = jnp.zeros([], jnp.float32)
  for x in float_leaves(tree):
    d = x - x
    if jnp.issubdtype(d.dtype, jnp.complexfloating):
      d = jnp.real(d) + jnp.imag(d)
    total = total + jnp.sum(d).astype(jnp.float32)
  return total


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
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
      raise TypeError(
        f"tree must be a pytree of arrays, got a leaf {leaf!r} of type {type(leaf).__name__} "
        f"in tree={tree!r}."
      )
  # One plain read of each leaf decides the common case (a finite sum of
  # squares proves every entry finite); only a sum that is not finite pays
  # for the entry-by-entry check, in a cond.
  sq = sum_squares(tree, names)
  return lax.cond(
    jnp.isfinite(sq), lambda t: jnp.bool_(True), lambda t: exact_all_finite(t, names), tree
  )


def exact_all_finite(tree: Any, axis_name: _multi_device.AxisName = None) -> jax.Array:
  """bool ``()``: :func:`all_finite` always entry by entry (one read, no cond)."""
  return jnp.isfinite(_multi_device.psum(nonfinite_sum(tree), axis_name))


def unscale(tree: Any, inv_scale: jax.Array) -> Any:
  """Multiplies each floating leaf by ``inv_scale`` in float32 (or wider) and
  casts back to the leaf's dtype; other leaves pass through unchanged."""

  def one(x):
    if not is_float(x):
      return x
    ct = compute_dtype(x.dtype)
    return (x.astype(ct) * inv_scale.astype(ct)).astype(x.dtype)

  return jax.tree.map(one, tree)


def leaf_amax(leaves: list[jax.Array]) -> list[jax.Array]:
  """Each leaf's largest real or imaginary magnitude, a ``()`` of the leaf's
  real dtype (0 for an empty leaf)."""
  out = []
  for x in leaves:
    part = jnp.real(x).dtype
    if not x.size:
      out.append(jnp.zeros([], part))
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
      out.append(jnp.maximum(jnp.max(jnp.abs(jnp.real(x))), jnp.max(jnp.abs(jnp.imag(x)))))
    else:
      out.append(jnp.max(jnp.abs(x)))
  return out


def global_amax(tree: Any, axis_name: _multi_device.AxisName = None) -> jax.Array:
  """float32 ``()``: largest absolute value over every floating leaf (0 if none),
  maximised over ``axis_name`` when given."""
  amax = jnp.zeros([], jnp.float32)
  for x in float_leaves(tree):
    if x.size:
      amax = jnp.maximum(amax, jnp.max(jnp.abs(x)).astype(jnp.float32))
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
  sizes = _multi_device.axis_sizes(axis_name)
  sq = jnp.zeros([], jnp.float32)
  for leaf in float_leaves(tree):
    x = leaf.astype(compute_dtype(leaf.dtype))
    part = jnp.sum(jnp.real(x * jnp.conj(x))).astype(jnp.float32)
    copies = _multi_device.replicas(leaf, sizes)
    sq = sq + (part / copies if copies > 1 else part)
  return _multi_device.psum(sq, axis_name)


def robust_norm(
  tree: Any, inv_scale: jax.Array | float = 1.0, axis_name: _multi_device.AxisName = None
) -> jax.Array:
  """float32 ``()``: global L2 norm of a finite ``tree`` times ``inv_scale``,
  without overflow in the squares (two reads of each leaf; :func:`sum_squares`
  is one).

  Each leaf is divided by its own largest real or imaginary magnitude ``m``
  before squaring; the per-leaf sums are combined relative to the largest
  ``m * inv_scale`` (taken in the leaf's compute dtype), so the result is inf
  only when the norm itself is past the float32 range. Axes as in
  :func:`sum_squares`.
  """
  sizes = _multi_device.axis_sizes(axis_name)
  leaves = float_leaves(tree)
  parts = []
  for leaf, m in zip(leaves, leaf_amax(leaves)):
    if not leaf.size:
      continue
    x = leaf.astype(compute_dtype(leaf.dtype))
    m = m.astype(x.real.dtype)
    m = jnp.where(m > 0, m, jnp.ones_like(m))
    y = x / m  # each read fuses on its own: nothing of the leaf's size is written
    q = jnp.sum(jnp.real(y * jnp.conj(y))).astype(jnp.float32)
    unscaled_m = (m * jnp.asarray(inv_scale, m.dtype)).astype(jnp.float32)
    parts.append((unscaled_m, q / _multi_device.replicas(leaf, sizes)))
  if not parts:
    return jnp.zeros([], jnp.float32)
  top = _multi_device.pmax(jnp.max(jnp.stack([m for m, _ in parts])), axis_name)
  # m == top covers top == inf (a leaf past float32 range: the norm is inf too).
  total = sum(q * jnp.square(jnp.where(m == top, 1.0, m / top)) for m, q in parts)
  return top * jnp.sqrt(_multi_device.psum(total, axis_name))


def valid_scale(scale: jax.Array) -> jax.Array:
  """bool ``()``: whether ``scale`` can unscale, i.e. ``0 < 1/scale < inf``:
  False for a scale that is NaN, +-inf, 0, negative or so small that its
  inverse overflows float32."""
  inv = 1.0 / jnp.asarray(scale, jnp.float32)
  return (inv > 0) & (inv < jnp.inf)


def finite_and_norm(
  grads: Any, scale: jax.Array, axis_name: _multi_device.AxisName = None
) -> tuple[jax.Array, jax.Array]:
  """``(finite, norm)`` of ``u = unscale(grads, 1/scale)``: whether ``scale`` is a
  valid loss scale (:func:`valid_scale`) and every entry of ``u`` is finite,
  reduced over ``axis_name``; and the global L2 norm of ``u``.

  On a normal step this is one fused read of each gradient leaf, and ``u``
  is never materialised: :func:`sum_squares` of the *scaled* gradients is
  finite only when every entry is. When the loss scale is at least 1,
  ``|u| <= |grads|`` entry by entry (rounding is monotone), so ``u`` is then
  finite too. Everything else goes to an exact path in a ``lax.cond`` that
  runs only then: a sum of squares that is not finite (a non-finite entry, or
  finite entries whose squares overflow), or a loss scale below 1, since
  unscaling can then overflow a finite gradient (e.g. a float16 leaf past
  65504). The exact path checks every entry of ``grads`` (``x - x`` is 0 for
  finite ``x`` of any size, NaN otherwise) and, for a scale below 1, each
  leaf's largest magnitude once unscaled: rounding is monotone, so that
  entry is the first to overflow. It then computes the norm without
  overflow. The flag is exact in every case, and neither path writes an
  array of a leaf's size.

  The norm is ``sqrt(sum_squares(grads)) / scale``, or, when the squares
  overflow float32, the same norm taken relative to each leaf's largest
  entry (see :func:`robust_norm`); inf or NaN when some entry is not finite
  or the scale is not valid. Without ``axis_name`` it is local. With it, the
  norm is that of the whole gradient as the devices hold it together: a leaf
  that varies over a named axis (``shard_map(check_vma=True)`` types say so)
  is taken to be sharded along it, so its squared norms are summed over that
  axis; over a named axis along which it does not vary it is replicated and
  counted once. Where JAX does not track variance (``pmap``,
  ``check_vma=False``) every leaf is taken to be replicated and the squared
  norm is averaged over the named axes: exact for data-parallel
  (all-reduced) gradients, and the same value on every device in every case.

  Returns:
    A bool ``()`` and a float32 ``()``, both identical on every device of the
    named axes.
  """
  valid = valid_scale(scale)
  inv_scale = jnp.where(valid, 1.0 / jnp.asarray(scale, jnp.float32), jnp.nan)
  sq = sum_squares(grads, axis_name)
  fast = jnp.isfinite(sq) & (inv_scale <= 1)

  def quick(g, i, s):
    return jnp.bool_(True), jnp.sqrt(s) * i

  def exact(g, i, s):
    # Rounding is monotone, so with a scale below 1 a leaf's largest magnitude
    # is the first entry to overflow when unscaled: checking it is exact, and
    # no array of the leaf's size is written.
    finite = exact_all_finite(g, axis_name) & lax.cond(
      i > 1,
      lambda: exact_all_finite(unscale(leaf_amax(float_leaves(g)), i), axis_name),
      lambda: jnp.bool_(True),
    )
    norm = lax.cond(
      finite & ~jnp.isfinite(s), lambda: robust_norm(g, i, axis_name), lambda: jnp.sqrt(s) * i
    )
    return finite, norm

  finite, norm = lax.cond(fast, quick, exact, grads, inv_scale, sq)
  return finite & valid, norm


# Squares of entries times 2**-100 stay finite for every float32 entry, and a
# norm past 2**128 (where the plain squares overflow) loses nothing measurable
# to the entries that 2**-100 flushes (those below about 2**25).
_HI = 2.0**-100


def finite_and_norm_fused(
  grads: Any, scale: jax.Array, axis_name: _multi_device.AxisName = None
) -> tuple[jax.Array, jax.Array]:
  """:func:`finite_and_norm` with no conditional: every statistic is a sibling
  reduction of the same read of each leaf, which XLA fuses into one pass on
  GPUs and TPUs, so no predicate has to reach the host.

  Per leaf: the sum of ``|x|**2``, the sum of ``|x * 2**-100|**2`` (finite
  for any float32 entries, where the first overflows), the sum of
  ``x - x`` (exact: NaN iff an entry is not finite) and the largest
  magnitude (unscaled, it tells whether a scale below 1 overflows a finite
  entry: rounding is monotone). The flag is exactly that of
  :func:`finite_and_norm`; the norm equals it when the squares do not
  overflow, and is within float32 rounding of it otherwise.
  """
  valid = valid_scale(scale)
  inv = jnp.where(valid, 1.0 / jnp.asarray(scale, jnp.float32), jnp.nan)
  sizes = _multi_device.axis_sizes(axis_name)
  leaves = float_leaves(grads)
  sq = sq_hi = bad = jnp.zeros([], jnp.float32)
  # A run-time factor: XLA folds (x * c)**2 into x**2 * c**2 for a constant c, and c**2 is 0.
  hi = lax.optimization_barrier(jnp.float32(_HI))
  for leaf, amax in zip(leaves, leaf_amax(leaves)):
    x = leaf.astype(compute_dtype(leaf.dtype))
    copies = _multi_device.replicas(leaf, sizes)
    y = x * hi.astype(x.real.dtype)
    sq = sq + jnp.sum(jnp.real(x * jnp.conj(x))).astype(jnp.float32) / copies
    sq_hi = sq_hi + jnp.sum(jnp.real(y * jnp.conj(y))).astype(jnp.float32) / copies
    d = x - x
    d = jnp.real(d) + jnp.imag(d) if jnp.issubdtype(d.dtype, jnp.complexfloating) else d
    unscaled = unscale(amax, jnp.where(inv > 1, inv, 1.0).astype(jnp.float32))
    bad = bad + jnp.sum(d).astype(jnp.float32) + (unscaled - unscaled).astype(jnp.float32)
  sq, sq_hi, bad = _multi_device.psum((sq, sq_hi, bad), axis_name)
  # sqrt(sq_hi) * 2**50 * inv * 2**50: no intermediate overflows or underflows unless the norm does.
  norm = jnp.where(jnp.isfinite(sq), jnp.sqrt(sq) * inv, jnp.sqrt(sq_hi) * 2.0**50 * inv * 2.0**50)
  return jnp.isfinite(bad) & valid, norm
