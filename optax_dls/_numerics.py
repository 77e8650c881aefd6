"""Numerics of loss scaling: the exact all-finite check, unscaling, gradient statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = str | Sequence[str] | None


def _is_float(x: Any) -> bool:
  return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _float_leaves(tree: Any) -> list[jax.Array]:
  return [jnp.asarray(x) for x in jax.tree.leaves(tree) if _is_float(x)]


def _compute_dtype(dtype: Any) -> Any:
  """float32 (complex64), or the leaf's own dtype where that is wider
  (float64 / complex128 under x64); float8 and other narrow floats too."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype
  return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def check_axis_name(axis_name: Any) -> str | tuple[str, ...] | None:
  """Returns ``axis_name`` as None, a string or a tuple; TypeError for anything else."""
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if isinstance(axis_name, (tuple, list)) and axis_name and all(isinstance(a, str) for a in axis_name):
    return tuple(axis_name)
  raise TypeError(f"axis_name must be None, a string or a non-empty tuple of strings, got {axis_name!r}.")


def _axis_names(axis_name: AxisName) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  if isinstance(axis_name, str):
    return (axis_name,)
  return tuple(axis_name)


def nonfinite_sum(tree: Any) -> jax.Array:
  """float32 ``()``: 0 when every floating leaf is finite, NaN otherwise.

  Uses ``x - x``, which is 0 for every finite ``x`` however large and NaN for
  inf, -inf and NaN: one fused read of each leaf, exact in every dtype.
  """
  total = jnp.zeros([], jnp.float32)
  for x in _float_leaves(tree):
    total = total + jnp.sum(_nan_if_nonfinite(x)).astype(jnp.float32)
  return total


def _nan_if_nonfinite(x: jax.Array) -> jax.Array:
  """Elementwise, real: ``x - x`` (real plus imaginary part), 0 where ``x`` is finite, else NaN."""
  d = x - x
  if jnp.issubdtype(d.dtype, jnp.complexfloating):
    d = jnp.real(d) + jnp.imag(d)
  return d


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
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
  names = _axis_names(check_axis_name(axis_name))
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
      raise TypeError(f"tree must be a pytree of arrays, got a leaf {leaf!r} of type {type(leaf).__name__} "
                      f"in tree={tree!r}.")
  # One plain read of each leaf decides the common case (a finite sum of
  # squares proves every entry finite); only a sum that is not finite pays
  # for the entry-by-entry check, in a cond.
  sq = sum_squares(tree, names)
  return lax.cond(jnp.isfinite(sq), lambda t: jnp.bool_(True), lambda t: exact_all_finite(t, names), tree)


def exact_all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """bool ``()``: :func:`all_finite` always entry by entry (one read, no cond)."""
  total = nonfinite_sum(tree)
  names = _axis_names(axis_name)
  return jnp.isfinite(lax.psum(total, names) if names else total)


def unscale(tree: Any, inv_scale: jax.Array) -> Any:
  """Multiplies each floating leaf by ``inv_scale`` in float32 (or wider) and
  casts back to the leaf's dtype; other leaves pass through unchanged."""

  def one(x):
    if not _is_float(x):
      return x
    ct = _compute_dtype(x.dtype)
    return (x.astype(ct) * inv_scale.astype(ct)).astype(x.dtype)

  return jax.tree.map(one, tree)


def _leaf_amax(tree: Any) -> list[jax.Array]:
  """Each floating leaf's largest real or imaginary magnitude, a ``()`` of the
  leaf's real dtype (0 for an empty leaf)."""
  out = []
  for x in _float_leaves(tree):
    part = jnp.real(x).dtype
    if not x.size:
      out.append(jnp.zeros([], part))
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
      out.append(jnp.maximum(jnp.max(jnp.abs(jnp.real(x))), jnp.max(jnp.abs(jnp.imag(x)))))
    else:
      out.append(jnp.max(jnp.abs(x)))
  return out


def global_amax(tree: Any) -> jax.Array:
  """float32 ``()``: largest absolute value over every floating leaf (0 if none)."""
  amax = jnp.zeros([], jnp.float32)
  for x in _float_leaves(tree):
    if x.size:
      amax = jnp.maximum(amax, jnp.max(jnp.abs(x)).astype(jnp.float32))
  return amax


# --- Multi-device reductions (pmap / shard_map) ---------------------------------


def varying_axes(x: Any) -> frozenset[str]:
  """Mesh axes over which ``x`` varies, as typed by ``shard_map(check_vma=True)``.

  Empty outside ``shard_map``, under ``shard_map(check_vma=False)`` and under
  ``pmap``, where JAX does not track it.
  """
  aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def tree_varying_axes(tree: Any) -> frozenset[str]:
  """Union of :func:`varying_axes` over the floating leaves of ``tree``."""
  axes = frozenset()
  for x in _float_leaves(tree):
    axes |= varying_axes(x)
  return axes


def check_axis_coverage(grads: Any, state_leaf: Any, axis_name: AxisName) -> None:
  """Raises ValueError when the gradients vary over a mapped axis that neither
  ``axis_name`` nor the (replicated) loss-scale state covers.

  Under ``shard_map`` with ``check_vma=True`` each gradient leaf's type says
  over which mesh axes it varies. If it varies over an axis missing from
  ``axis_name`` while the loss scale does not, each device would decide alone
  whether to skip and the replicated loss-scale state would diverge. Runs at
  trace time; a no-op where JAX does not track variance (``pmap``,
  ``check_vma=False``).
  """
  missing = tree_varying_axes(grads) - varying_axes(state_leaf) - set(_axis_names(axis_name))
  if missing:
    raise ValueError(
        f"axis_name={axis_name!r} does not cover the mapped axes {sorted(missing)} over which "
        f"the gradients vary (gradient axes found: {sorted(tree_varying_axes(grads))}). "
        "Without them each device decides alone whether to skip and the loss-scale state "
        "stops being replicated. Pass axis_name="
        f"{tuple(sorted(set(_axis_names(axis_name)) | missing))!r} to the loss-scaled "
        "transformation, or give each device its own state (shard it over those axes).")


def _axis_sizes(axis_name: AxisName) -> dict[str, int]:
  """Size of each named axis; ValueError (at trace time) for a name not mapped here."""
  try:
    return {n: lax.axis_size(n) if hasattr(lax, "axis_size") else lax.psum(1, n)
            for n in _axis_names(axis_name)}
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} names an axis that is not mapped here ({e}). Under jax.jit with "
        "NamedSharding leave axis_name=None; under pmap / shard_map / vmap pass the names of the "
        "mapped axes.") from e


def sum_squares(tree: Any, axis_name: AxisName = None) -> jax.Array:
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
  names = _axis_names(axis_name)
  sizes = _axis_sizes(axis_name) if names else {}
  sq = jnp.zeros([], jnp.float32)
  for leaf in _float_leaves(tree):
    x = leaf.astype(_compute_dtype(leaf.dtype))
    part = jnp.sum(jnp.real(x * jnp.conj(x))).astype(jnp.float32)
    copies = _replicas(leaf, names, sizes)
    sq = sq + (part / copies if copies > 1 else part)
  return lax.psum(sq, names) if names else sq


def _replicas(leaf: jax.Array, names: tuple[str, ...], sizes: dict[str, int]) -> int:
  """How many devices of the named axes hold the same copy of ``leaf``."""
  copies = 1
  for n in set(names) - varying_axes(leaf):
    copies *= sizes[n]
  return copies


def robust_norm(tree: Any, inv_scale: jax.Array | float = 1.0, axis_name: AxisName = None) -> jax.Array:
  """float32 ``()``: global L2 norm of a finite ``tree`` times ``inv_scale``,
  without overflow in the squares (two reads of each leaf; :func:`sum_squares`
  is one).

  Each leaf is divided by its own largest real or imaginary magnitude ``m``
  before squaring; the per-leaf sums are combined relative to the largest
  ``m * inv_scale`` (taken in the leaf's compute dtype), so the result is inf
  only when the norm itself is past the float32 range. Axes as in
  :func:`sum_squares`.
  """
  names = _axis_names(axis_name)
  sizes = _axis_sizes(axis_name) if names else {}
  leaves = _float_leaves(tree)
  parts = []
  for leaf, m in zip(leaves, _leaf_amax(leaves)):
    if not leaf.size:
      continue
    x = leaf.astype(_compute_dtype(leaf.dtype))
    m = m.astype(x.real.dtype)
    m = jnp.where(m > 0, m, jnp.ones_like(m))
    y = x / m  # each read fuses on its own: nothing of the leaf's size is written
    q = jnp.sum(jnp.real(y * jnp.conj(y))).astype(jnp.float32)
    unscaled_m = (m * jnp.asarray(inv_scale, m.dtype)).astype(jnp.float32)
    parts.append((unscaled_m, q / _replicas(leaf, names, sizes)))
  if not parts:
    return jnp.zeros([], jnp.float32)
  top = jnp.max(jnp.stack([m for m, _ in parts]))
  if names:
    top = lax.pmax(top, names)
  # m == top covers top == inf (a leaf past float32 range: the norm is inf too).
  total = sum(q * jnp.square(jnp.where(m == top, 1.0, m / top)) for m, q in parts)
  return top * jnp.sqrt(lax.psum(total, names) if names else total)


def finite_and_norm(grads: Any, inv_scale: jax.Array,
                    axis_name: AxisName = None) -> tuple[jax.Array, jax.Array]:
  """``(all_finite(u, axis_name), global L2 norm of u)`` for ``u = unscale(grads, inv_scale)``.

  On a normal step this is one fused read of each gradient leaf, and ``u``
  is never materialised: :func:`sum_squares` of the *scaled* gradients is
  finite only when every entry is. When the loss scale is at least 1
  (``inv_scale <= 1``), ``|u| <= |grads|`` entry by entry (rounding is
  monotone), so ``u`` is then finite too. Everything else goes to an exact
  path in a ``lax.cond`` that runs only then: a sum of squares that is not
  finite (a non-finite entry, or finite entries whose squares overflow), or
  a loss scale below 1 (whatever set it: the policy, ``reset_scale`` or a
  fallback), since unscaling can then overflow a finite gradient (e.g. a
  float16 leaf past 65504). The exact path checks every entry of ``grads`` (``x - x`` is
  0 for finite ``x`` of any size, NaN otherwise) and, for a scale below 1,
  each leaf's largest magnitude once unscaled: rounding is monotone, so that
  entry is the first to overflow. It then computes the norm without
  overflow. The flag is exact in every case, and neither path writes an
  array of a leaf's size.

  The norm is ``sqrt(sum_squares(grads)) * inv_scale``, or, when the squares
  overflow float32, the same norm taken relative to each leaf's largest
  entry (see :func:`robust_norm`), times ``inv_scale``;
  inf or NaN when some entry is not finite. Without ``axis_name`` it is
  local. With it, the norm is that of the whole gradient as the devices hold
  it together: a leaf that varies over a named axis
  (``shard_map(check_vma=True)`` types say so) is taken to be sharded along
  it, so its squared norms are summed over that axis; over a named axis along
  which it does not vary it is replicated and counted once. Where JAX does
  not track variance (``pmap``, ``check_vma=False``) every leaf is taken to
  be replicated and the squared norm is averaged over the named axes: exact
  for data-parallel (all-reduced) gradients, and the same value on every
  device in every case.

  Returns:
    A bool ``()`` and a float32 ``()``, both identical on every device of the
    named axes.
  """
  inv_scale = jnp.asarray(inv_scale, jnp.float32)
  sq = sum_squares(grads, axis_name)
  fast = jnp.isfinite(sq) & (inv_scale <= 1)

  def quick(g, i, s):
    return jnp.bool_(True), jnp.sqrt(s) * i

  def exact(g, i, s):
    # Rounding is monotone, so with a scale below 1 a leaf's largest magnitude
    # is the first entry to overflow when unscaled: checking it is exact, and
    # no array of the leaf's size is written.
    finite = exact_all_finite(g, axis_name) & lax.cond(
        i > 1, lambda: exact_all_finite(unscale(_leaf_amax(g), i), axis_name), lambda: jnp.bool_(True))
    norm = lax.cond(finite & ~jnp.isfinite(s), lambda: robust_norm(g, i, axis_name), lambda: jnp.sqrt(s) * i)
    return finite, norm

  return lax.cond(fast, quick, exact, grads, inv_scale, sq)


def reduced_amax(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """:func:`global_amax` of ``tree``, maximised over ``axis_name`` when given."""
  amax = global_amax(tree)
  names = _axis_names(axis_name)
  return lax.pmax(amax, names) if names else amax


def zeros_of(struct: Any) -> jax.Array:
  """Zeros of a ``jax.ShapeDtypeStruct``'s shape and dtype, varying over the same
  ``shard_map`` mesh axes (so both branches of a skip ``lax.cond`` type-match)."""
  z = jnp.zeros(struct.shape, struct.dtype)
  mat = getattr(struct, "manual_axis_type", None)
  axes = tuple(sorted(mat.varying if mat is not None else (getattr(struct, "vma", None) or ())))
  if not axes:
    return z
  return lax.pcast(z, axes, to="varying") if hasattr(lax, "pcast") else lax.pvary(z, axes)
