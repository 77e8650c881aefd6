"""Helpers for wrapping a user's function: ``(loss, aux)``, ``argnums``, order, dtypes, arrays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def loss_and_aux(f: Callable[..., Any], has_aux: bool, out: Any) -> tuple[Any, Any]:
  """``(loss, aux)`` of ``out`` (aux None without ``has_aux``); TypeError for no pair."""
  if not has_aux:
    return out, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    got = f"an array of shape {out.shape}" if hasattr(out, "shape") else f"a {type(out).__name__}"
    raise TypeError(
      f"with has_aux=True, fun ({getattr(f, '__qualname__', f)!r}) must return a (loss, aux) "
      f"pair, got {got}."
    )
  return out[0], out[1]


def check_reach(argnums: int | tuple[int, ...], args: tuple[Any, ...], first: str) -> None:
  """TypeError when ``argnums`` reaches beyond ``args``."""
  needed = max(argnums) if isinstance(argnums, tuple) else argnums
  if needed >= len(args):
    raise TypeError(
      f"argnums={argnums!r} asks for positional argument {needed} of fun, but "
      f"grad_fn({first}, *args) was called with {len(args)} positional arguments after {first}."
    )


def order_error(
  first: str, expected: str, lacks: str, has: str, got: Any, swapped: int | None
) -> str:
  """The message for a ``grad_fn(first, *args)`` whose first argument is not ``expected``."""
  message = (
    f"grad_fn takes {expected} first and fun's arguments after it, grad_fn({first}, *args); "
    f"the first argument given {lacks}: got a {type(got).__name__}."
  )
  if swapped is not None:
    message += f" The {_ordinal(swapped + 2)} argument {has}: the arguments look swapped."
  return message


def _ordinal(n: int) -> str:
  words = ("first", "second", "third", "fourth", "fifth")
  return words[n - 1] if n <= len(words) else f"{n}th"


def first_index(args: tuple[Any, ...], test: Callable[[Any], bool]) -> int | None:
  """The position of the first of ``args`` that passes ``test``, or None."""
  return next((i for i, a in enumerate(args) if test(a)), None)


def promoted(out_a: Any, out_b: Any, names: tuple[str, str]) -> Any:
  """``out_a``'s shapes with dtypes promoted with ``out_b``'s; ValueError where shapes differ."""
  leaves_a, leaves_b = jax.tree_util.tree_leaves_with_path(out_a), jax.tree.leaves(out_b)
  for (path, a), b in zip(leaves_a, leaves_b):
    if a.shape != b.shape:
      raise ValueError(
        f"{names[0]} and {names[1]} outputs differ in shape at output"
        f"{jax.tree_util.keystr(path)}: {a.shape} vs {b.shape}."
      )
  promote = lambda a, b: jax.ShapeDtypeStruct(a.shape, jnp.promote_types(a.dtype, b.dtype))
  return jax.tree.map(promote, out_a, out_b)


def cast(out: Any, types: Any) -> Any:
  """Each leaf of ``out`` as an array of the dtype of its leaf in ``types``."""
  return jax.tree.map(lambda x, t: jnp.asarray(x, t.dtype), out, types)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def split_arrays(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
  """The array leaves of ``tree`` and the function that puts them back among the others."""
  leaves, treedef = jax.tree.flatten(tree)

  def rebuild(arrays: list[Any]) -> Any:
    given = iter(arrays)
    return jax.tree.unflatten(treedef, [next(given) if _is_array(x) else x for x in leaves])

  return [x for x in leaves if _is_array(x)], rebuild
