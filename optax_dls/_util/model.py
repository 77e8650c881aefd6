"""Leaves that are not floating arrays (Equinox functions, integers): held out or passed through."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _NONE(x: Any) -> bool:
  return x is None


def _zip(grads: Any, *trees: Any) -> tuple[Any, list[tuple[Any, ...]]]:
  """``(treedef of grads, [(gradient, subtree of each of trees)] per leaf)``."""
  leaves, treedef = jax.tree.flatten(grads, is_leaf=_NONE)
  subs = [treedef.flatten_up_to(tree) for tree in trees]  # type: ignore[attr-defined]
  return treedef, list(zip(leaves, *subs, strict=True))


def _places(grads: Any, params: Any, pick: Any) -> list[bool] | None:
  """``pick(gradient, parameter subtree)`` per leaf of ``grads``; None if none or no match."""
  try:
    places = [pick(*row) for row in _zip(grads, params)[1]]
  except (ValueError, TypeError):
    return None
  return places if any(places) else None


def _without(grads: Any, tree: Any, places: list[bool]) -> Any:
  """``tree`` (of the structure of ``params``) with None at ``places``."""
  treedef, rows = _zip(grads, tree)
  return jax.tree.unflatten(treedef, [None if h else s for (_, s), h in zip(rows, places)])


def _not_trained(x: Any) -> bool:
  return _is_array(x) and not jnp.issubdtype(x.dtype, jnp.inexact)


def trained(params: Any) -> Any:
  """``params`` with None at its integer and bool arrays: what the inner ``init`` sees."""
  return jax.tree.map(lambda x: None if _not_trained(x) else x, params)


def inner_update(update: Any, grads: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
  """``update(grads, *args, params, **kwargs)`` without the integer and bool parameters."""
  tree = grads if params is None else params
  places = _places(grads, tree, lambda g, p: g is not None and _not_trained(p))
  if places is None:
    return update(grads, *args, params, **kwargs)
  kept_params = None if params is None else _without(grads, params, places)
  updates, state = update(_without(grads, grads, places), *args, kept_params, **kwargs)
  treedef, rows = _zip(grads, updates, tree)
  filled = [
    _passed(g, None if params is None else p) if t else u
    for (g, u, p), t in zip(rows, places, strict=True)
  ]
  return jax.tree.unflatten(treedef, filled), state


def _passed(grad: Any, param: Any) -> Any:
  """An integer parameter's update: its gradient, or zeros for ``float0`` (None for a key)."""
  if grad.dtype != jax.dtypes.float0:
    return grad
  if param is None or jax.dtypes.issubdtype(param.dtype, jax.dtypes.prng_key):
    return None
  return jnp.zeros_like(param)


def recorded(grads: Any, params: Any, held: list[bool] | None) -> Any:
  """``grads`` with zeros where a floating parameter's gradient is None (frozen)."""
  if held is None:
    return grads
  treedef, rows = _zip(grads, params)
  frozen = [h and not has_non_arrays(p) for (_, p), h in zip(rows, held, strict=True)]
  if not any(frozen):
    return grads  # only functions and other leaves that are not floating arrays held out
  zero = lambda x: jnp.zeros_like(x) if _is_inexact_array(x) else None
  filled = [jax.tree.map(zero, p) if f else g for (g, p), f in zip(rows, frozen, strict=True)]
  return jax.tree.unflatten(treedef, filled)


def held_apart(grads: Any, params: Any) -> tuple[list[bool] | None, Any, list[Any]]:
  """``(held, kept, out)``: which gradients are None, ``params`` without them, the held-out."""
  held = None if params is None else _places(grads, params, lambda g, p: g is None)
  if held is None:
    return None, params, []
  rows = _zip(grads, params)[1]
  return held, _without(grads, params, held), [p for (_, p), h in zip(rows, held) if h]


def _is_module(x: Any) -> bool:
  eqx = sys.modules.get("equinox")  # never imported here: without it, no Equinox module
  return eqx is not None and isinstance(x, eqx.Module)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def arrays_of_modules(tree: Any) -> Any:
  """``tree`` with None at an Equinox module's leaves that are not arrays (``eqx.filter``)."""
  if sys.modules.get("equinox") is None:
    return tree
  arrays = lambda node: jax.tree.map(lambda x: x if _is_array(x) else None, node)
  return jax.tree.map(lambda n: arrays(n) if _is_module(n) else n, tree, is_leaf=_is_module)


def check_init_params(params: Any) -> None:
  """TypeError naming a function, a string or an Equinox module's non-array in ``params``."""
  marked = jax.tree.map(
    lambda n: jax.tree.map(lambda _: True, n) if _is_module(n) else False,
    params,
    is_leaf=_is_module,
  )
  inside = jax.tree.leaves(marked)
  for (path, leaf), in_module in zip(jax.tree_util.tree_leaves_with_path(params), inside):
    bad = callable(leaf) or isinstance(leaf, (str, bytes))
    if bad or (in_module and not _is_array(leaf)):
      raise TypeError(
        f"init takes the parameters' arrays, got the leaf {leaf!r} of type "
        f"{type(leaf).__name__} at params{jax.tree_util.keystr(path)}: for an Equinox "
        "model pass eqx.filter(model, eqx.is_array)."
      )


def _is_inexact_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)


def has_non_arrays(tree: Any) -> bool:
  """Whether a leaf of ``tree`` is not a floating array."""
  return not all(_is_inexact_array(x) for x in jax.tree.leaves(tree))


def partition(tree: Any) -> tuple[Any, Any]:
  """``(arrays, others)``, as ``eqx.partition(tree, eqx.is_inexact_array)``."""
  arrays = jax.tree.map(lambda x: x if _is_inexact_array(x) else None, tree)
  return arrays, jax.tree.map(lambda x: None if _is_inexact_array(x) else x, tree)


def combine(arrays: Any, others: Any) -> Any:
  """The inverse of :func:`partition`."""
  return jax.tree.map(lambda x, y: y if x is None else x, arrays, others, is_leaf=_NONE)
