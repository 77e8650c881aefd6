"""Leaves by path, alike for a live pytree and a stored one, and how two such trees differ."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

Path = tuple[str, ...]
_SHOWN = 8  # paths listed per kind of difference


def live_leaves(tree: Any) -> dict[Path, Any]:
  """The leaves of a pytree by path, each key a string."""
  return {live_path(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def live_path(keys: tuple[Any, ...]) -> Path:
  """A ``jax.tree_util`` key path as a :data:`Path` of strings."""
  return tuple(jax.tree_util.keystr((k,), simple=True, separator="") for k in keys)


def stored_leaves(tree: Any, path: Path = ()) -> dict[Path, Any]:
  """The leaves by path of a stored (Orbax, flax) or in-memory tree."""
  items = None if tree is None else children(tree)
  if items is None:
    return {} if tree is None else {path: tree}
  return {p: leaf for key, value in items for p, leaf in stored_leaves(value, (*path, key)).items()}


def children(tree: Any) -> list[tuple[str, Any]] | None:
  """The ``(key, child)`` pairs of a stored tree's node, or None for a leaf."""
  if isinstance(tree, Mapping):
    return [(str(k), v) for k, v in tree.items()]
  if is_namedtuple(tree):  # in memory (an optax state)
    return [(str(f), getattr(tree, f)) for f in tree._fields]
  if isinstance(tree, (list, tuple)):
    return [(str(i), v) for i, v in enumerate(tree)]
  return None


def is_namedtuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, "_fields")


def show(path: Path) -> str:
  return ".".join(path) or "(the root)"


class Difference(NamedTuple):
  """How a stored tree differs from a target, leaf by leaf."""

  only_stored: list[Path]
  only_target: list[Path]
  shapes: list[tuple[Path, tuple[int, ...], tuple[int, ...]]]  # path, stored, target
  dtypes: list[tuple[Path, Any, Any]]  # path, stored, target

  def blocks(self) -> bool:
    """Whether a leaf is missing on a side or a shape differs (a dtype is converted)."""
    return bool(self.only_stored or self.only_target or self.shapes)

  def describe(self) -> str:
    """The difference in words, each kind with its first few paths."""
    pairs = lambda rows: [f"{show(p)}: checkpoint {a}, target {b}" for p, a, b in rows]
    parts = [
      _listed("only in the checkpoint", [show(p) for p in self.only_stored]),
      _listed("only in the target", [show(p) for p in self.only_target]),
      _listed("shapes differ", pairs(self.shapes)),
      _listed("dtypes differ", pairs(self.dtypes)),
    ]
    return "; ".join(p for p in parts if p)


def _listed(what: str, items: list[str]) -> str:
  if not items:
    return ""
  more = f", and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
  return f"{what} ({len(items)}): {', '.join(items[:_SHOWN])}{more}"


def difference(stored: dict[Path, Any], target: dict[Path, Any]) -> Difference:
  """How the ``stored`` leaves differ from the ``target``'s (a Python number has no dtype)."""
  both = [(p, stored[p], target[p]) for p in target if p in stored]
  shapes = [(p, _shape(a), _shape(b)) for p, a, b in both if _shape(a) != _shape(b)]
  dtypes = [
    (p, _dtype(a), _dtype(b))
    for p, a, b in both
    if _shape(a) == _shape(b) and None not in (_dtype(a), _dtype(b)) and _dtype(a) != _dtype(b)
  ]
  only_stored = sorted(p for p in stored if p not in target)
  return Difference(only_stored, sorted(p for p in target if p not in stored), shapes, dtypes)


def _shape(leaf: Any) -> tuple[int, ...]:
  return tuple(leaf.shape) if hasattr(leaf, "shape") else tuple(np.shape(leaf))


def _dtype(leaf: Any) -> Any:
  if isinstance(leaf, (bool, int, float, complex)):
    return None
  dtype = getattr(leaf, "dtype", None)
  return None if dtype is None else np.dtype(dtype)


def is_variable(x: Any) -> bool:
  """Whether ``x`` is a flax nnx ``Variable`` or a linen box (flax not imported)."""
  return any(
    (c.__name__ == "Variable" and c.__module__.startswith("flax.nnx"))
    or (c.__name__ == "AxisMetadata" and c.__module__.startswith("flax.core"))
    for c in type(x).__mro__
  )


def unboxed(x: Any) -> Any:
  """The array an nnx ``Variable`` or a linen box holds; any other leaf as it is."""
  if not is_variable(x):
    return x
  if not hasattr(x, "get_raw_value") and not hasattr(x, "raw_value"):
    return x.value  # a linen box
  # flax >= 0.12: get_raw_value (raw_value deprecated); 0.11: raw_value only.
  return x.get_raw_value() if hasattr(x, "get_raw_value") else x.raw_value
