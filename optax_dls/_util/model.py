"""Models whose pytree holds leaves that are not floating arrays (an Equinox module's
functions, Python scalars, integer arrays): held out of the step or passed through
untouched, as ``eqx.apply_updates`` does."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _NONE(x: Any) -> bool:
  return x is None


def held_out(grads: Any, params: Any) -> list[bool] | None:
  """Per leaf of ``grads``: whether it is ``None`` (its parameter subtree held out); None
  when nothing is, or ``params`` does not match."""
  return _places(grads, params, lambda g, p: g is None)


def untrained(grads: Any, params: Any) -> list[bool] | None:
  """Per leaf of ``grads``: whether it is the gradient of an integer or bool array (by the
  parameter, or the gradient's dtype without ``params``); None when there is none."""
  if params is None:
    leaves = jax.tree.leaves(grads, is_leaf=_NONE)
    places = [g is not None and _not_trained(g) for g in leaves]
    return places if any(places) else None
  return _places(grads, params, lambda g, p: g is not None and _not_trained(p))


def _places(grads: Any, params: Any, pick: Any) -> list[bool] | None:
  if params is None:
    return None
  leaves, treedef = jax.tree.flatten(grads, is_leaf=_NONE)
  try:
    subs = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
  except (ValueError, TypeError):
    return None
  places = [pick(g, p) for g, p in zip(leaves, subs, strict=True)]
  return places if any(places) else None


def _not_trained(x: Any) -> bool:
  return _is_array(x) and not jnp.issubdtype(x.dtype, jnp.inexact)


def trained(params: Any) -> Any:
  """``params`` with None at its integer and bool arrays: what the inner ``init`` sees."""
  return jax.tree.map(lambda x: None if _not_trained(x) else x, params)


def inner_update(update: Any, grads: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
  """``update(grads, *args, params, **kwargs)`` without the integer parameters: their
  gradient, untouched, is their update (zeros for a ``float0`` one)."""
  places = untrained(grads, params)
  if places is None:
    return update(grads, *args, params, **kwargs)
  kept_grads = without(grads, grads, places)
  kept_params = None if params is None else without(grads, params, places)
  updates, state = update(kept_grads, *args, kept_params, **kwargs)
  leaves, treedef = jax.tree.flatten(grads, is_leaf=_NONE)
  ups = treedef.flatten_up_to(updates)  # type: ignore[attr-defined]
  subs = [None] * len(leaves) if params is None else treedef.flatten_up_to(params)  # type: ignore[attr-defined]
  filled = [_passed(g, p) if t else u for g, u, p, t in zip(leaves, ups, subs, places, strict=True)]
  return jax.tree.unflatten(treedef, filled), state


def _passed(grad: Any, param: Any) -> Any:
  """An integer parameter's update: its gradient, or zeros for ``float0`` (None for a key)."""
  if grad.dtype != jax.dtypes.float0:
    return grad
  if param is None or jax.dtypes.issubdtype(param.dtype, jax.dtypes.prng_key):
    return None
  return jnp.zeros_like(param)


def recorded(grads: Any, params: Any, held: list[bool] | None) -> Any:
  """``grads`` with zeros where a floating parameter's gradient is None (frozen), so that
  the record has a bit for every floating parameter; ``held`` is :func:`held_out`'s."""
  if held is None:
    return grads
  leaves, treedef = jax.tree.flatten(grads, is_leaf=_NONE)
  subs = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
  if not any(h and not has_non_arrays(p) for p, h in zip(subs, held, strict=True)):
    return grads  # only functions and other leaves that are not floating arrays held out
  zero = lambda x: jnp.zeros_like(x) if _is_inexact_array(x) else None
  filled = [
    jax.tree.map(zero, p) if h and not has_non_arrays(p) else g
    for g, p, h in zip(leaves, subs, held, strict=True)
  ]
  return jax.tree.unflatten(treedef, filled)


def split(grads: Any, params: Any, held: list[bool]) -> tuple[Any, list[Any]]:
  """``(params with None at the held-out places, the held-out subtrees)``."""
  treedef = jax.tree.structure(grads, is_leaf=_NONE)
  subs = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
  kept = [None if h else s for s, h in zip(subs, held, strict=True)]
  return jax.tree.unflatten(treedef, kept), [s for s, h in zip(subs, held, strict=True) if h]


def held_apart(grads: Any, params: Any) -> tuple[list[bool] | None, Any, list[Any]]:
  """``(held, kept, static)``: :func:`held_out`, and :func:`split` where something is held."""
  held = held_out(grads, params)
  if held is None:
    return None, params, []
  kept, static = split(grads, params, held)
  return held, kept, static


def merge(grads: Any, kept: Any, held: list[bool], out: list[Any]) -> Any:
  """The inverse of :func:`split`: ``kept`` with the held-out subtrees ``out`` back."""
  treedef = jax.tree.structure(grads, is_leaf=_NONE)
  subs = treedef.flatten_up_to(kept)  # type: ignore[attr-defined]
  rest = iter(out)
  return jax.tree.unflatten(
    treedef, [next(rest) if h else s for s, h in zip(subs, held, strict=True)]
  )


def without(grads: Any, tree: Any, held: list[bool]) -> Any:
  """``tree`` (of the structure of ``params``) with None at the held-out places."""
  return split(grads, tree, held)[0]


def _is_module(x: Any) -> bool:
  eqx = sys.modules.get("equinox")  # never imported here: without it, no Equinox module
  return eqx is not None and isinstance(x, eqx.Module)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def arrays_of_modules(tree: Any) -> Any:
  """``tree`` with None at every leaf of an Equinox module that is not an array, as
  ``eqx.filter(model, eqx.is_array)``."""
  if sys.modules.get("equinox") is None:
    return tree
  arrays = lambda node: jax.tree.map(lambda x: x if _is_array(x) else None, node)
  return jax.tree.map(lambda n: arrays(n) if _is_module(n) else n, tree, is_leaf=_is_module)


def check_init_params(params: Any) -> None:
  """TypeError naming the leaf where ``params`` holds a function, a string, or an
  Equinox module's leaf that is not an array: ``init`` takes the arrays alone."""
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
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [x if _is_inexact_array(x) else None for x in leaves]
  others = [None if _is_inexact_array(x) else x for x in leaves]
  return jax.tree.unflatten(treedef, arrays), jax.tree.unflatten(treedef, others)


def combine(arrays: Any, others: Any) -> Any:
  """The inverse of :func:`partition`."""
  a, treedef = jax.tree.flatten(arrays, is_leaf=_NONE)
  b = jax.tree.leaves(others, is_leaf=_NONE)
  return jax.tree.unflatten(treedef, [y if x is None else x for x, y in zip(a, b, strict=True)])
