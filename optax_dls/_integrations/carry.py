"""A state saved without loss scaling carried into a loss-scaled target."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from optax_dls._core.state import LossScaleState
from optax_dls._util import tree_paths as _tree_paths


def target_states(tree: Any) -> list[_tree_paths.Path]:
  """The paths of the loss-scale states in a live pytree."""
  is_state = lambda x: isinstance(x, LossScaleState)
  found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
  return [_tree_paths.live_path(p) for p, x in found if is_state(x)]


def into_loss_scaled(restored: Any, target: Any) -> Any:
  """Puts a checkpoint saved without loss scaling into a loss-scaled target.

  Every leaf of ``restored`` goes to its place in ``target``, the old optimizer state to
  the loss-scale state's ``inner_state``, each converted to the target leaf's dtype and
  sharding; the loss-scale fields keep the target's values (the scale at ``init_scale``,
  the counters at 0). Nothing is left at a default: a leaf on one side only, or of another
  shape, is an error.

  Args:
    restored: the tree of a checkpoint whose optimizer state has no
      :class:`~optax_dls.LossScaleState`, as restored without a target
      (``manager.restore(step)``, or flax's ``restore_checkpoint(directory,
      target=None)``): dicts and lists of arrays and numbers, or an optax state in memory.
    target: the new layout, e.g. ``{'params': params, 'opt_state': tx.init(params)}`` or
      a flax ``TrainState`` with the loss-scaled ``tx``: a pytree of arrays (or
      ``jax.ShapeDtypeStruct``, outside the loss-scale state's own fields) holding exactly
      one :class:`~optax_dls.LossScaleState`.

  Returns:
    ``target`` with the restored values: the same tree structure, dtypes and shardings.

  Raises:
    ValueError: ``target`` holds no loss-scale state or several; or ``restored`` and
      ``target`` differ other than by that state (the leaves and shapes listed).
    TypeError: a field of the target's loss-scale state is a ``jax.ShapeDtypeStruct``.

  Example:
    >>> import numpy as np, jax.numpy as jnp, optax, optax_dls
    >>> params = {'w': jnp.ones(2)}
    >>> adam = {'count': np.int32(3), 'mu': {'w': np.zeros(2)}, 'nu': {'w': np.zeros(2)}}
    >>> raw = {'params': {'w': np.ones(2)}, 'opt_state': [adam, None]}  # as Orbax stores it
    >>> tx = optax_dls.dynamic_loss_scale(optax.adam(0.1))
    >>> target = {'params': params, 'opt_state': tx.init(params)}
    >>> state = optax_dls.checkpoint.into_loss_scaled(raw, target)
    >>> lss = optax_dls.find_state(state)
    >>> int(lss.inner_state[0].count), float(lss.loss_scale)
    (3, 32768.0)
  """
  states = target_states(target)
  if len(states) != 1:
    raise ValueError(
      f"target must hold exactly one LossScaleState (the state of the loss-scaled optimizer "
      f"to restore into), got {len(states)}: build it with tx.init(params), tx a "
      "dynamic_loss_scale / loss_scaled optimizer."
    )
  (prefix,) = states
  leaves, treedef = jax.tree.flatten(target)
  paths = list(_tree_paths.live_leaves(target))
  sources = [_source(p, prefix) for p in paths]  # where each target leaf comes from
  stored = _tree_paths.stored_leaves(restored)
  wanted = {s: leaf for s, leaf in zip(sources, leaves) if s is not None}
  diff = _tree_paths.difference(stored, wanted)
  if diff.blocks():
    raise ValueError(
      "restored does not have the target's layout once the target's loss-scale state at "
      f"{_tree_paths.show(prefix)} is replaced by its inner state: {diff.describe()}."
    )
  abstract = [
    _tree_paths.show(p)
    for p, s, leaf in zip(paths, sources, leaves)
    if s is None and isinstance(leaf, jax.ShapeDtypeStruct)
  ]
  if abstract:  # the loss-scale fields keep the target's values: it must have some
    raise TypeError(
      f"target's loss-scale state at {_tree_paths.show(prefix)} must hold arrays, got "
      f"jax.ShapeDtypeStruct at {', '.join(abstract[:3])}: its values (the scale at "
      "init_scale, the counters at 0) are the ones kept, since the checkpoint has none. Build "
      "it with tx.init(params); the other leaves of target may be abstract."
    )
  values = [leaf if s is None else like(leaf, stored[s]) for s, leaf in zip(sources, leaves)]
  return jax.tree.unflatten(treedef, values)


def _source(path: _tree_paths.Path, prefix: _tree_paths.Path) -> _tree_paths.Path | None:
  """Where the target leaf at ``path`` is in a checkpoint without the loss-scale state at
  ``prefix`` (the inner state one level up); None for that state's own fields."""
  if path[: len(prefix)] != prefix:
    return path
  rest = path[len(prefix) :]
  return (*prefix, *rest[1:]) if rest[0] == "inner_state" else None


def like(target: Any, value: Any) -> Any:
  """``value`` of the target leaf's dtype and sharding, or of its Python type."""
  if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
    array = jax.numpy.asarray(value, target.dtype)
    sharding = getattr(target, "sharding", None)
    return array if sharding is None else jax.device_put(array, sharding)
  if isinstance(target, (np.ndarray, np.generic)):
    return np.asarray(value, target.dtype)
  if isinstance(target, (bool, int, float, complex)):
    return type(target)(np.asarray(value).item())
  return value
