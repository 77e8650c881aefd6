"""Multi-device reductions: axis names, variance over mesh axes, and the coverage check.
Under ``pmap`` and ``shard_map`` a skip decision is reduced over every mapped axis the
gradients vary over, or each device would decide alone."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

AxisName = str | Sequence[str] | None


def check_axis_name(axis_name: Any) -> str | tuple[str, ...] | None:
  """Returns ``axis_name`` as None, a string or a tuple; TypeError for anything else."""
  if axis_name is None or (isinstance(axis_name, str) and axis_name):
    return axis_name
  names = axis_name if isinstance(axis_name, (tuple, list)) else ()
  if names and all(isinstance(a, str) and a for a in names):
    return tuple(names)
  raise TypeError(
    f"axis_name must be None, a non-empty string or a non-empty tuple of them, got "
    f"{axis_name!r}: the name(s) of the mapped axes (pmap / shard_map) the gradients vary over."
  )


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
  """``axis_name`` as a tuple of names (empty for None)."""
  if axis_name is None:
    return ()
  if isinstance(axis_name, str):
    return (axis_name,)
  return tuple(axis_name)


def psum(x: Any, axis_name: AxisName) -> Any:
  """``lax.psum`` over the named axes, or ``x`` itself when there are none."""
  names = axis_names(axis_name)
  return lax.psum(_varying_over(x, names), names) if names else x


def pmax(x: Any, axis_name: AxisName) -> Any:
  """``lax.pmax`` over the named axes, or ``x`` itself when there are none."""
  names = axis_names(axis_name)
  return lax.pmax(_varying_over(x, names), names) if names else x


def _varying_over(x: Any, names: tuple[str, ...]) -> Any:
  """``x`` made to vary over the ``shard_map`` axes among ``names``: a named axis the value
  is replicated over (gradients sharded over another) is then reduced, not refused."""
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ()
  return _vary_over(x, set(names) & set(manual))


def varying_axes(x: Any) -> frozenset[str]:
  """Mesh axes over which ``x`` (an array or a ``ShapeDtypeStruct``) varies under
  ``shard_map(check_vma=True)``; empty wherever JAX does not track it."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", None) or ())


def vary_like(x: jax.Array, like: Any) -> jax.Array:
  """``x`` made to vary over the mesh axes ``like`` varies over (none outside ``shard_map``)."""
  return _vary_over(x, varying_axes(like))


def _vary_over(x: Any, axes: set[str] | frozenset[str]) -> Any:
  """``x`` made to vary over ``axes`` as well as over those it varies over already."""
  missing = tuple(sorted(set(axes) - varying_axes(x)))
  return pcast_varying(x, missing) if missing else x


def shard_like(x: jax.Array, like: Any) -> jax.Array:
  """``x`` resharded to ``like``'s sharding where ``like`` is typed with ``Explicit`` mesh
  axes and ``x``'s differs: an old value of the inner state placed otherwise (replicated,
  say) than the new value the inner update computes from the gradients, as a bare
  optimizer's new state takes the gradients' sharding. A no-op everywhere else."""
  want = _sharding(like)
  if getattr(want, "spec", None) in (None, getattr(_sharding(x), "spec", None)):
    return x
  types = getattr(getattr(want, "mesh", None), "axis_types", ()) or ()
  if jax.sharding.AxisType.Explicit not in types:
    return x
  # The sharding itself (its mesh with it), not the spec alone: no mesh context is needed.
  return jax.sharding.reshard(x, want)


def _sharding(x: Any) -> Any:
  """The sharding of an array, a tracer or a ``jax.ShapeDtypeStruct``."""
  return getattr(x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x), "sharding", None)


def pcast_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``x`` made to vary over mesh ``axes``: ``lax.pcast(..., to="varying")`` (jax >= 0.8.2),
  ``lax.pvary`` before it."""
  return lax.pcast(x, axes, to="varying") if hasattr(lax, "pcast") else lax.pvary(x, axes)  # type: ignore[attr-defined]


def check_axis_coverage(grad_leaves: Sequence[Any], state_leaf: Any, axis_name: AxisName) -> None:
  """ValueError at trace time when the gradients vary (``shard_map(check_vma=True)``) over
  a mesh axis that neither ``axis_name`` nor the replicated loss-scale state covers: each
  device would decide alone and the state would diverge."""
  found = frozenset().union(*map(varying_axes, grad_leaves))
  if not found - varying_axes(state_leaf):  # nothing to cover (no shard_map, or replicated)
    return
  given = axis_names(axis_name)
  missing = found - varying_axes(state_leaf) - set(given)
  if missing:
    unmapped = [n for n in given if not _is_mapped(n)]
    mapped = mapped_axes()
    typo = ""
    if unmapped:
      guesses = {n: difflib.get_close_matches(n, sorted(missing), n=1) for n in unmapped}
      typo = (
        f"{', '.join(repr(n) for n in unmapped)} is not a mapped axis here"
        + "".join(f" (did you mean {g[0]!r}?)" for g in guesses.values() if g)
        + ("" if mapped is None else f"; the mapped axes here are {mapped}")
        + ". "
      )
    keep = tuple(sorted((set(given) - set(unmapped)) | missing))
    raise ValueError(
      f"axis_name={axis_name!r} does not cover the mapped axes {sorted(missing)} over which "
      f"the gradients vary (gradient axes found: {sorted(found)}). {typo}"
      "Without them each device decides alone whether to skip and the loss-scale state "
      f"stops being replicated. Pass axis_name={(keep[0] if len(keep) == 1 else keep)!r} to the "
      "loss-scaled transformation, or give each device its own state (shard it over those "
      "axes)."
    )


def _is_mapped(name: Any) -> bool:
  """Whether ``name`` is an axis mapped where this is traced (shard_map, pmap, vmap)."""
  try:
    lax.axis_size(name)
  except NameError:
    return False
  return True


def axis_sizes(axis_name: AxisName) -> dict[str, int]:
  """Size of each named axis; ValueError (at trace time) for a name not mapped here."""
  try:
    return {n: lax.axis_size(n) for n in axis_names(axis_name)}
  except NameError as e:
    unmapped = [n for n in axis_names(axis_name) if not _is_mapped(n)]
    mapped = mapped_axes()
    where = (
      "no axis is mapped here"
      if mapped == []
      else "the mapped axes here are unknown"
      if mapped is None
      else f"the mapped axes here are {mapped}"
    )
    others = [m for m in mapped or [] if m not in axis_names(axis_name)]
    guesses = [difflib.get_close_matches(str(n), others, n=1) for n in unmapped]
    raise ValueError(
      f"axis_name={axis_name!r}: {', '.join(repr(n) for n in unmapped)} is not a mapped axis "
      f"({where}"
      + "".join(f"; did you mean {g[0]!r}?" for g in guesses if g)
      + "). Under pmap / shard_map / vmap pass the names of mapped axes only; under jax.jit "
      "with NamedSharding leave axis_name=None."
    ) from e


def mapped_axes() -> list[str] | None:
  """The names of the axes mapped where this is traced (shard_map, pmap, vmap), sorted; None
  when this JAX does not say."""
  try:
    from jax._src import core  # no public API lists the axes in scope

    return sorted(str(n) for n in core.get_axis_env().axis_sizes)
  except (ImportError, AttributeError):
    return None


def replicas(leaf: Any, sizes: dict[str, int]) -> int:
  """How many devices of the named axes (``sizes``) hold the same copy of ``leaf``:
  the product of the sizes of the named axes along which it does not vary."""
  copies = 1
  for n in set(sizes) - varying_axes(leaf):
    copies *= sizes[n]
  return copies
