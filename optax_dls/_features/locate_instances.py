"""Which instance of a repeated block each operation of :func:`optax_dls.locate` ran in: a user
call is named by the path shared by the parameters it applies to data (``blocks/2``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jax_core

from optax_dls._core import record as _record
from optax_dls._features import jax_source as _jax_source
from optax_dls._util import tree_paths as _tree_paths

Path = tuple[str, ...]
_CONSTANT = "constant"  # a value made of literals and the jaxpr's constants alone
Kind = Path | str | None  # a parameter's path, _CONSTANT, or None: data


def leaf_paths(tree: Any) -> list[Path]:
  """The path of each leaf of ``tree``, keys written as ``nonfinite_leaves`` writes them."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_tree_paths.is_variable)[0]
  return [_named(path) for path, leaf in flat for _ in jax.tree.leaves(leaf)]


def _named(path: Any) -> Path:
  return tuple(_record.path_name([k]) for k in path)


def given_paths(args: Sequence[Any]) -> frozenset[Path]:
  """The paths of the arrays in a call's arguments (``linear1/weight`` in a block's ``self``)."""
  flat = [(path, leaf) for value in args for path, leaf in _flat(value) if path]
  is_array = lambda x: _tree_paths.is_variable(x) or isinstance(x, jax.Array)
  return frozenset(_named(path) for path, leaf in flat if is_array(leaf))


def _flat(value: Any) -> list[tuple[Any, Any]]:
  try:
    return jax.tree_util.tree_flatten_with_path(value, is_leaf=_tree_paths.is_variable)[0]
  except Exception:  # noqa: BLE001 - an argument JAX cannot flatten holds no parameter
    return []


def names(
  closed: Any,
  kinds: Sequence[Kind],
  calls: Sequence[str],
  given: Mapping[str, frozenset[Path]],
  body: Callable[[Any], tuple[Any, list[Any]] | None],
) -> dict[str, str]:
  """``{call scope: path}`` for the ``calls`` that are a block instance, from each input's kind.
  Not named: a call applying every parameter, or none sharing a path, or run at several places."""
  applied: dict[str, set[Path]] = {}
  every: set[Path] = set()
  # Per call, the bodies whose equations it opened: several when run at several places.
  bodies: dict[str, set[int]] = {}

  def walk(jaxpr: Any, kinds_in: Sequence[Kind], outer: Sequence[str], at: int) -> list[Kind]:
    kind: dict[Any, Kind] = {v: _CONSTANT for v in jaxpr.constvars}
    kind.update(zip(jaxpr.invars, kinds_in))

    def of(v: Any) -> Kind:
      return _CONSTANT if isinstance(v, jax_core.Literal) else kind.get(v)

    for eqn in jaxpr.eqns:
      for name in _jax_source.scopes(eqn):
        if name.startswith(_jax_source.CALL):
          bodies.setdefault(name, set()).add(at)
      ins = [of(v) for v in eqn.invars]
      entered = body(eqn)
      if entered is not None:
        outs = walk(entered[0], ins, _jax_source.scopes(eqn, outer), id(eqn))
      else:
        outs = [_apply(eqn, ins, outer, applied, every)] * len(eqn.outvars)
      kind.update(zip(eqn.outvars, outs))
    return [of(v) for v in jaxpr.outvars]

  walk(closed.jaxpr, list(kinds), (), 0)
  out = {}
  for call in calls:
    paths = applied.get(call)
    if not paths or paths >= every or len(bodies.get(call, ())) > 1:
      continue
    shared = _shared(_places(paths, given.get(call, frozenset())))
    if shared:
      out[call] = "/".join(shared)
  return out


def _places(paths: set[Path], given: frozenset[Path]) -> set[Path]:
  """Each of ``paths`` without the longest of ``given`` it ends with; ``paths`` if none does."""
  held = set()
  for p in paths:
    suffix = max(
      (len(r) for r in given if len(r) <= len(p) and p[len(p) - len(r) :] == r), default=0
    )
    if suffix:
      held.add(p[: len(p) - suffix])
  return held or paths


def _apply(
  eqn: Any, ins: list[Kind], outer: Sequence[str], applied: dict[str, set[Path]], every: set[Path]
) -> Kind:
  """The kind of ``eqn``'s outputs; parameters applied to data noted for its calls."""
  params = {k for k in ins if isinstance(k, tuple)}
  if any(k is None for k in ins):
    if params:
      every.update(params)
      for name in _jax_source.scopes(eqn, outer):
        if name.startswith(_jax_source.CALL):
          applied.setdefault(name, set()).update(params)
    return None
  if len(params) == 1:
    return next(iter(params))  # a parameter cast, transposed, scaled by a constant
  return None if params else _CONSTANT


def _shared(paths: set[Path]) -> Path:
  """The longest path every one of ``paths`` starts with."""
  return tuple(k[0] for k in itertools.takewhile(lambda k: len(set(k)) == 1, zip(*paths)))
