"""Models whose pytree holds leaves that are not arrays (an Equinox module's activation
functions, Python scalars, strings) or integer arrays: the parameters whose gradient is
``None``, and integer and bool arrays, are held out of the step and passed through
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
  """Per leaf of ``grads`` (``None`` leaves included): whether it is ``None``, so the
  parameter subtree at its place is held out of the step; None when nothing is held
  out or ``params`` does not have the structure of ``grads``."""
  return _places(grads, params, lambda g, p: g is None)


def untrained(grads: Any, params: Any) -> list[bool] | None:
  """Per leaf of ``grads``: whether it is the gradient (not None) of an integer or bool
  array, which the inner optimizer does not see (:func:`trained`): told by the parameter,
  or, with ``params`` None, by the gradient's own dtype (integer, bool, ``float0``); None
  when there is none or ``params`` does not have the structure of ``grads``."""
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
  """``params`` with None at its integer and bool arrays (an Equinox model's index arrays
  or counters): what the inner optimizer's ``init`` sees. Every step keeps them from the
  inner update: held out where their gradient is None (:func:`held_out`), their
  gradient passed through untouched as their update otherwise (:func:`inner_update`)."""
  return jax.tree.map(lambda x: None if _not_trained(x) else x, params)


def inner_update(update: Any, grads: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
  """``update(grads, *args, params, **kwargs) -> (updates, state)`` without the integer
  parameters whose gradient is not None (:func:`untrained`): None at their places in the
  gradients and parameters it sees, and their gradient, untouched, as their update (zeros
  of the parameter's type for a ``float0`` one, ``jax.grad(..., allow_int=True)``'s, which
  ``optax.apply_updates`` cannot add)."""
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
  """The update of an integer parameter: its gradient, or, for a ``float0`` one, zeros of
  the parameter's type (None for a PRNG key, or without the parameter: nothing to add)."""
  if grad.dtype != jax.dtypes.float0:
    return grad
  if param is None or jax.dtypes.issubdtype(param.dtype, jax.dtypes.prng_key):
    return None
  return jnp.zeros_like(param)


def recorded(grads: Any, params: Any, held: list[bool] | None) -> Any:
  """``grads`` as the check and the record read them: zeros of the parameter's type where a
  floating parameter's gradient is None (frozen by ``multi_transform`` and
  ``set_to_zero``, say), so that the record has a bit for every floating parameter, in the
  order of the names :func:`optax_dls.nonfinite_leaves` gives them; ``grads`` itself where no
  such parameter is held out. ``held`` is :func:`held_out`'s."""
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
  """``(held, kept, static)``: :func:`held_out`, and :func:`split` where something is held
  out (``params`` itself and no subtrees where nothing is)."""
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
  """``tree`` with None at every leaf of an Equinox module that is not an array (its
  functions, Python numbers and bools), as ``eqx.filter(model, eqx.is_array)`` gives a
  model's parameters; ``tree`` itself where it holds no Equinox module."""
  if sys.modules.get("equinox") is None:
    return tree
  arrays = lambda node: jax.tree.map(lambda x: x if _is_array(x) else None, node)
  return jax.tree.map(lambda n: arrays(n) if _is_module(n) else n, tree, is_leaf=_is_module)


def check_init_params(params: Any) -> None:
  """TypeError naming the leaf and the fix where ``params`` holds a function or a string,
  or an Equinox module holds a leaf that is not an array (a whole Equinox model, whose
  Python numbers and bools, such as ``Dropout.p``, are not parameters): ``init`` takes the
  arrays alone."""
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


def _is_jax_type(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _is_inexact_array(x: Any) -> bool:
  """What ``eqx.filter_value_and_grad`` differentiates: a floating or complex array."""
  return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)


def has_non_arrays(tree: Any) -> bool:
  """Whether a leaf of ``tree`` is not a floating array (a function, a string, a Python
  number or bool, an integer array): then only its floating arrays are differentiated."""
  return not all(_is_inexact_array(x) for x in jax.tree.leaves(tree))


def partition(tree: Any) -> tuple[Any, Any]:
  """``(arrays, others)``: ``tree`` twice, with None at the leaves that are not floating
  arrays, and with None at those that are (as ``eqx.partition(tree, eqx.is_inexact_array)``)."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [x if _is_inexact_array(x) else None for x in leaves]
  others = [None if _is_inexact_array(x) else x for x in leaves]
  return jax.tree.unflatten(treedef, arrays), jax.tree.unflatten(treedef, others)


def combine(arrays: Any, others: Any) -> Any:
  """The inverse of :func:`partition`."""
  a, treedef = jax.tree.flatten(arrays, is_leaf=_NONE)
  b = jax.tree.leaves(others, is_leaf=_NONE)
  return jax.tree.unflatten(treedef, [y if x is None else x for x, y in zip(a, b, strict=True)])
