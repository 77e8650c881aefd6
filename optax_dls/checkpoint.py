"""Orbax checkpoints: restoring an optimizer state, with a clear error when its layout differs.

A public submodule: ``optax_dls.checkpoint.restore``. Orbax (``orbax-checkpoint``)
is imported only when :func:`restore` runs.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

from optax_dls._state import LossScaleState

__all__ = ["restore"]

_FIELDS_KEYS = ("loss_scale", "inner_state")


def _target_layouts(tree: Any) -> dict[str, tuple[str, ...]]:
  paths, _ = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, LossScaleState)
  )
  return {
    jax.tree_util.keystr(p): LossScaleState._fields
    for p, x in paths
    if isinstance(x, LossScaleState)
  }


def _saved_layouts(tree: Any, path: str = "") -> dict[str, tuple[str, ...]]:
  """Loss-scale states in Orbax metadata, where NamedTuples are stored as dicts."""
  found = {}
  if isinstance(tree, dict):
    if all(k in tree for k in _FIELDS_KEYS):
      found[path] = tuple(sorted(tree))
    items = tree.items()
  elif isinstance(tree, (list, tuple)):
    items = enumerate(tree)
  else:
    return found
  for k, v in items:
    found.update(_saved_layouts(v, f"{path}[{k!r}]"))
  return found


def _explain(saved: dict, target: dict, step: int, directory: Any) -> str:
  head = f"The checkpoint at step {step} in {directory} does not have the target's layout. "
  if target and not saved:
    return head + (
      f"The target holds a loss-scale state (LossScaleState) at {', '.join(target)}; the "
      "checkpoint holds none: it was saved from an optimizer without loss scaling. To start "
      "loss scaling from it, restore with a target built by the unwrapped optimizer "
      "(e.g. optax.adam(...).init(params)), then put the restored state in place of the "
      "inner state: opt_state = tx.init(params)._replace(inner_state=restored_inner). "
      "The loss scale then starts at init_scale."
    )
  if saved and not target:
    return head + (
      f"The checkpoint holds a loss-scale state at {', '.join(saved)}; the target holds "
      "none. Restore with a target built by the same loss-scaled optimizer "
      "(optax_dls.dynamic_loss_scale(...).init(params)); to drop loss scaling, keep "
      "optax_dls.find_state(restored).inner_state."
    )
  if saved and target:
    lines = [f"checkpoint {p}: fields {', '.join(f)}" for p, f in saved.items()]
    lines += [f"target {p}: fields {', '.join(sorted(f))}" for p, f in target.items()]
    return head + (
      "Both hold a loss-scale state but their layouts differ (a different policy, inner "
      "optimizer or optax_dls version): " + "; ".join(lines) + ". Build the target with "
      "the optimizer and version the checkpoint was saved with."
    )
  return head + "Neither holds a loss-scale state; see the Orbax message below."


def _check_target(target: Any) -> None:
  """TypeError unless ``target`` is a non-empty pytree of arrays, numbers or ``jax.ShapeDtypeStruct``."""
  leaves = jax.tree_util.tree_leaves_with_path(target)
  if not leaves:
    raise TypeError(
      f"target must be a pytree of arrays or jax.ShapeDtypeStruct with the layout to "
      f"restore (e.g. {{'params': params, 'opt_state': tx.init(params)}}), got {target!r}."
    )
  for path, leaf in leaves:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, jax.ShapeDtypeStruct)):
      raise TypeError(
        f"target must be a pytree of arrays or jax.ShapeDtypeStruct, got the leaf {leaf!r} "
        f"of type {type(leaf).__name__} at target{jax.tree_util.keystr(path)}."
      )


def _check_step(manager: Any, step: Any) -> int:
  """``step`` as an int, or the latest saved step when it is None.

  TypeError / ValueError for a step that is not a whole number >= 0,
  FileNotFoundError when no checkpoint is saved at it.
  """
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {manager.directory}.")
    return step
  if isinstance(step, (bool, np.bool_)) or not isinstance(step, (numbers.Integral, np.integer)):
    raise TypeError(f"step must be an int or None, got {step!r} of type {type(step).__name__}.")
  if step < 0:
    raise ValueError(f"step must be >= 0, got step={step!r}.")
  saved = list(manager.all_steps())
  if int(step) not in saved:
    raise FileNotFoundError(
      f"no checkpoint at step {int(step)} in {manager.directory}; saved steps: "
      f"{sorted(saved) or 'none'}."
    )
  return int(step)


def restore(manager: Any, target: Any, step: int | None = None) -> Any:
  """Restores a pytree (e.g. ``{'params': ..., 'opt_state': ...}``) saved with Orbax.

  The checkpoint must have been saved with
  ``manager.save(step, args=orbax.checkpoint.args.StandardSave(tree))``. The
  result has ``target``'s tree structure (``LossScaleState`` and optax
  NamedTuples included), dtypes, shapes and shardings: pass concrete arrays
  (e.g. a fresh ``tx.init(params)``) or ``jax.ShapeDtypeStruct`` leaves with a
  ``sharding``. Nothing runs on the restored state, so the loss scale, growth
  tracker and every counter are exactly those saved.

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager``.
    target: a pytree of arrays or ``jax.ShapeDtypeStruct`` with the expected
      layout.
    step: int, the step to restore; default ``None`` is the latest one.

  Returns:
    The restored pytree.

  Raises:
    TypeError: ``manager`` is not an ``orbax.checkpoint.CheckpointManager``,
      ``target`` is not a non-empty pytree of arrays, numbers or
      ``jax.ShapeDtypeStruct``, or ``step`` is neither an int nor None.
    ValueError: ``step`` < 0; or the saved tree structure differs from
      ``target``'s: the message says where a loss-scale state is expected and
      found, and how to restore a checkpoint saved with or without loss
      scaling. Other Orbax errors pass through unchanged.
    FileNotFoundError: no checkpoint at ``step`` (the message lists the saved
      steps), or ``step`` is None and the manager has no checkpoint.
  """
  import orbax.checkpoint as ocp  # optional dependency: only needed here

  if not isinstance(manager, ocp.CheckpointManager):
    raise TypeError(
      f"manager must be an orbax.checkpoint.CheckpointManager, got {manager!r} of type "
      f"{type(manager).__name__}."
    )
  _check_target(target)
  step = _check_step(manager, step)

  def abstract(x):
    return x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x)

  try:
    return manager.restore(step, args=ocp.args.StandardRestore(jax.tree.map(abstract, target)))
  except ValueError as err:
    if "structure" not in str(err):
      raise
    saved = _saved_layouts(manager.item_metadata(step).tree)
    raise ValueError(
      _explain(saved, _target_layouts(target), step, manager.directory) + f"\nOrbax: {err}"
    ) from err
