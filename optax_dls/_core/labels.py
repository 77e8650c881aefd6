"""Parameter-group labels: a pytree of strings matching the gradients (or a prefix of
them), or a callable ``params -> such a pytree``, as in ``optax.multi_transform``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from optax_dls._core import numerics as _numerics
from optax_dls._core import record as _localisation
from optax_dls._util import tree_paths as _tree_paths

Labels = Any  # None, a pytree of strings, or a callable tree -> pytree of strings


def check_labels(labels: Labels, owner: str, reserved: tuple[str, ...] = ()) -> Labels:
  """``labels`` checked where it can be before the tree is known (a callable is checked
  when applied); ``owner`` names the function in the messages."""
  if labels is None or callable(labels):
    return labels
  leaves = jax.tree.leaves(labels)
  if not leaves:
    raise ValueError(
      f"{owner} labels must be None, a callable or a non-empty pytree of strings, got {labels!r}."
    )
  for label in leaves:
    check_label(label, owner, reserved)
  return labels


def check_label(label: Any, owner: str, reserved: tuple[str, ...] = ()) -> str:
  """``label`` if it is a non-empty string without ``/``, not in ``reserved``."""
  if not isinstance(label, str):
    raise TypeError(
      f"{owner} labels must be strings, got label {label!r} of type {type(label).__name__}."
    )
  if not label or "/" in label or label in reserved:
    extra = f" and other than {reserved}" if reserved else ""
    raise ValueError(
      f"{owner} labels must be non-empty strings without '/'{extra}, got label {label!r}."
    )
  return label


def leaf_labels(labels: Labels, tree: Any, owner: str, reserved: tuple[str, ...] = ()) -> list[str]:
  """The label of each floating leaf of ``tree``, in ``jax.tree.leaves`` order
  (trace-time Python; ValueError when ``labels`` does not match ``tree``)."""
  resolved = labels(tree) if isinstance(labels, Callable) else labels  # type: ignore[arg-type]
  label_leaves, treedef = jax.tree.flatten(resolved)
  try:
    subtrees = treedef.flatten_up_to(tree)  # type: ignore[attr-defined]
  except (ValueError, TypeError) as e:
    raise ValueError(f"{owner} labels do not match the gradient tree structure: {e}") from None
  out = []
  for label, sub in zip(label_leaves, subtrees, strict=True):
    out += [check_label(label, owner, reserved)] * len(_numerics.float_leaves(sub))
  return out


def leaf_names(tree: Any) -> list[str]:
  """The unique key-path names of the floating leaves of ``tree``, in the order of the
  record's bits (:func:`optax_dls._access.names.leaf_names` says how they are written)."""
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_tree_paths.is_variable)
  floats = [path for path, x in leaves if _numerics.is_float(_tree_paths.unboxed(x))]
  return _localisation.unique([_localisation.path_name(path) for path in floats])
