"""Orbax checkpoints: :func:`restore` an optimizer state (a clear error when its layout
differs), and :func:`into_loss_scaled` for a checkpoint saved without loss scaling. Orbax
(the ``checkpoint`` extra) is imported only when :func:`restore` runs."""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from optax_dls._core import skip as _skip
from optax_dls._integrations.carry import into_loss_scaled, like, target_states
from optax_dls._util import optional as _optional
from optax_dls._util import tree_paths as _tree_paths

__all__ = ["into_loss_scaled", "restore"]

# Fields a LossScaleState held before it kept only what was learned: dropped on restore.
_RETIRED_FIELDS = ("min_scale", "max_scale", "last_step_finite")
# Fields an earlier layout lacked (the old record of non-finite leaves included): the target's.
_NEW_FIELDS = (("nonfinite",), ("nonfinite", "names_digest"), ("overflows",))


def _stored_nodes(tree: Any, keys: tuple[str, ...], path: _tree_paths.Path = ()) -> list[Any]:
  """The paths of the dicts holding all of ``keys`` in a stored tree (NamedTuples as dicts)."""
  found = [path] if isinstance(tree, Mapping) and all(k in tree for k in keys) else []
  for k, v in _tree_paths.children(tree) or []:
    found += _stored_nodes(v, keys, (*path, k))
  return found


def _where(paths: list[_tree_paths.Path]) -> str:
  return ", ".join(_tree_paths.show(p) for p in paths)


def _advice(saved: Any, target: Any) -> str:
  """What to do about the loss-scale states of the stored tree ``saved`` and of ``target``."""
  in_saved = _stored_nodes(saved, ("loss_scale", "inner_state"))
  in_target = target_states(target)
  dynamic = _stored_nodes(saved, ("scale", "fin_steps"))  # a flax DynamicScale
  head = f"The target holds a loss-scale state (LossScaleState) at {_where(in_target)}; the "
  if in_target and not in_saved and dynamic:
    return (
      f"{head}checkpoint holds none, and a flax DynamicScale at {_where(dynamic)}. Convert "
      "it: optax_dls.flax.from_dynamic_scale(manager.restore(step), target) (see "
      "docs/guide/checkpoints.md#from-flax-s-dynamicscale)."
    )
  if in_target and not in_saved:
    return (
      f"{head}checkpoint holds none: it was saved without loss scaling. Convert it: "
      "optax_dls.checkpoint.into_loss_scaled(raw, target), with raw the tree restored "
      "without a target (manager.restore(step) with Orbax; for a directory flax's "
      "save_checkpoint wrote, flax.training.checkpoints.restore_checkpoint(directory, "
      "target=None)); the loss scale then starts at init_scale."
    )
  if in_saved and in_target and _where(in_saved) != _where(in_target):
    return (
      f"{head}checkpoint holds it at {_where(in_saved)}: the optimizer around it changed (a "
      "chain reordered, a wrapper added or removed). Restore with a target built by the "
      "optimizer that saved it, with the same chain and wrappers."
    )
  if in_saved and not in_target:
    return (
      f"The checkpoint holds a loss-scale state at {_where(in_saved)}; the target holds "
      "none. Restore with a target built by the same loss-scaled optimizer; to drop loss "
      "scaling, keep optax_dls.find_state(restored).inner_state."
    )
  return ""


def _check_target(target: Any) -> None:
  """TypeError unless ``target`` is a non-empty pytree of arrays, numbers or abstract ones."""
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
  """``step`` as an int (the latest saved one for None); FileNotFoundError where none is."""
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
  """Restores a pytree (e.g. ``{'params': ..., 'opt_state': ...}``) saved with Orbax's
  ``manager.save(step, args=orbax.checkpoint.args.StandardSave(tree))``.

  The result has ``target``'s tree structure (``LossScaleState`` and optax NamedTuples
  included), dtypes, shapes, shardings and weak types (a jitted step compiles no second
  program); the counters are those saved. The transformation it is restored into supplies
  the configuration: its first update unscales by the saved S, then applies its own rule
  (1 under ``no_loss_scale``; the initial scale where the saved one is not valid). A
  checkpoint of an earlier layout (a ``LossScaleState`` that also held ``min_scale`` and
  ``max_scale``, or lacked a current field) restores too.

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager``, or the directory (``str`` or
      ``os.PathLike``) one saved to, or that flax's ``save_checkpoint`` saved to.
    target: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with a ``sharding``) with
      the expected layout, e.g. a fresh ``tx.init(params)``.
    step: int >= 0, the step to restore; default ``None``: the latest one.

  Returns:
    The restored pytree.

  Raises:
    TypeError: ``manager`` is neither a ``CheckpointManager`` nor a path, ``target`` is
      not a non-empty pytree of arrays, numbers or ``jax.ShapeDtypeStruct``, or ``step``
      is neither an int nor None.
    ValueError: ``step`` < 0; or the saved layout differs from ``target``'s: the message
      says where a loss-scale state is expected and found, and what to do. Other Orbax
      errors pass through unchanged.
    FileNotFoundError: no checkpoint at ``step`` (the saved steps listed), none at all,
      or no such directory.

  Example:
    A run saved under ``dynamic_loss_scale``, resumed in bfloat16 without loss scaling::

      tx = optax_dls.no_loss_scale(optax.adamw(3e-4))
      target = {'params': params, 'opt_state': tx.init(params)}
      state = optax_dls.checkpoint.restore(directory, target)  # its first update: S = 1
  """
  ocp = _optional.require("orbax.checkpoint", "optax_dls.checkpoint.restore")  # only needed here
  manager = _manager(ocp, manager)
  _check_target(target)
  step = _check_step(manager, step)

  def abstract(x: Any) -> Any:
    return x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x)

  try:
    restored = manager.restore(step, args=ocp.args.StandardRestore(jax.tree.map(abstract, target)))
  except ValueError as err:
    saved = manager.item_metadata(step).tree
    diff = _tree_paths.difference(_tree_paths.stored_leaves(saved), _tree_paths.live_leaves(target))
    if not diff.blocks():
      raise  # not a difference of layout: Orbax's own error
    if not _only_retired(diff, _tree_paths.stored_leaves(saved)):
      # Orbax's message follows as the cause; its advice (a partial restore) would drop the
      # optimizer state that into_loss_scaled keeps.
      head = (
        f"The checkpoint at step {step} in {manager.directory} does not have the target's layout."
      )
      what = diff.describe() and f"What differs: {diff.describe()}."
      raise ValueError(" ".join(p for p in (head, _advice(saved, target), what) if p)) from err
    restored = _placed(manager.restore(step, args=ocp.args.StandardRestore()), target)
  return jax.tree.map(_weak_as, target, restored)


def _weak_as(target: Any, value: Any) -> Any:
  """``value`` weakly typed where its target leaf is a weakly typed scalar (flax's
  ``TrainState.step``), which Orbax restores strongly typed: no second compiled program."""
  if not (
    _skip.weak(target)
    and isinstance(value, jax.Array)
    and value.shape == ()
    and value.dtype == target.dtype
    and value.is_fully_addressable
  ):
    return value
  scalar = jax.numpy.asarray(value.item())
  return jax.device_put(scalar, value.sharding) if scalar.dtype == value.dtype else value


def _manager(ocp: Any, manager: Any) -> Any:
  """``manager`` itself, or a ``CheckpointManager`` over the directory it names."""
  if isinstance(manager, ocp.CheckpointManager):
    return manager
  if not isinstance(manager, (str, os.PathLike)):
    raise TypeError(
      f"manager must be an orbax.checkpoint.CheckpointManager or a checkpoint directory (a "
      f"str or os.PathLike), got {manager!r} of type {type(manager).__name__}."
    )
  directory = os.path.abspath(os.fspath(manager))
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory!r} (manager={manager!r}).")
  if _FlaxSteps.steps(directory):
    return _FlaxSteps(ocp, directory)
  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))


class _FlaxSteps:
  """The ``checkpoint_<step>`` folders flax's ``save_checkpoint`` writes, read through the
  few ``CheckpointManager`` methods :func:`restore` calls."""

  _PREFIX = "checkpoint_"

  def __init__(self, ocp: Any, directory: str) -> None:
    self.directory, self._ocp = directory, ocp

  @classmethod
  def steps(cls, directory: str) -> dict[int, str]:
    found = {}
    for name in os.listdir(directory):
      number, folder = name[len(cls._PREFIX) :], os.path.join(directory, name)
      if name.startswith(cls._PREFIX) and number.isdigit() and os.path.isdir(folder):
        found[int(number)] = folder
    return found

  def all_steps(self) -> list[int]:
    return sorted(self.steps(self.directory))

  def latest_step(self) -> int | None:
    return max(self.all_steps(), default=None)

  def item_metadata(self, step: int) -> Any:
    return self._ocp.StandardCheckpointer().metadata(self.steps(self.directory)[step]).item_metadata

  def restore(self, step: int, args: Any) -> Any:
    folder = self.steps(self.directory)[step]
    return self._ocp.StandardCheckpointer().restore(folder, getattr(args, "item", None))


def _only_retired(diff: _tree_paths.Difference, stored: dict[_tree_paths.Path, Any]) -> bool:
  """Whether ``diff`` is only fields an earlier layout of a loss-scale state held or lacked."""

  def in_a_state(node: _tree_paths.Path) -> bool:  # the node holds a loss-scale state's fields
    return all((*node, f) in stored for f in ("loss_scale", "num_steps", "num_skipped"))

  def old_record(p: _tree_paths.Path) -> bool:
    return any(p[i] == "nonfinite" and in_a_state(p[:i]) for i in range(len(p)))

  retired = all(
    (p[-1] in _RETIRED_FIELDS and in_a_state(p[:-1])) or old_record(p) for p in diff.only_stored
  )
  new = all(
    any(p[-len(f) :] == f and in_a_state(p[: -len(f)]) for f in _NEW_FIELDS)
    for p in diff.only_target
  )
  return bool(diff.only_stored or diff.only_target) and retired and new and not diff.shapes


def _placed(restored: Any, target: Any) -> Any:
  """``target`` with each leaf from the stored tree ``restored`` at its path, as the target
  leaf is; the target's own where the checkpoint has none."""
  leaves, treedef = jax.tree.flatten(target)
  stored = _tree_paths.stored_leaves(restored)
  paths = list(_tree_paths.live_leaves(target))
  values = [like(x, stored[p]) if p in stored else x for p, x in zip(paths, leaves)]
  return jax.tree.unflatten(treedef, values)
