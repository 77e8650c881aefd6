"""A state saved without loss scaling carried into a loss-scaled target, and the port from flax's
``DynamicScale`` (public as :func:`optax_dls.flax.from_dynamic_scale`; flax is not imported)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dls._access import find as _find
from optax_dls._core.state import LossScaleState
from optax_dls._util import tree_paths as _tree_paths
from optax_dls._util import validation as _validation


def target_states(tree: Any) -> list[_tree_paths.Path]:
  """The paths of the loss-scale states in a live pytree."""
  is_state = lambda x: isinstance(x, LossScaleState)
  found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
  return [_tree_paths.live_path(p) for p, x in found if is_state(x)]


def into_loss_scaled(restored: Any, target: Any) -> Any:
  """Puts a checkpoint saved without loss scaling into a loss-scaled target.

  The old optimizer state goes to ``inner_state``; the loss-scale fields keep the target's values
  (the scale at ``init_scale``, the counters at 0).

  Args:
    restored: a checkpoint tree whose optimizer state has no :class:`~optax_dls.LossScaleState`,
      as restored without a target (``manager.restore(step)``, flax's
      ``restore_checkpoint(directory, target=None)``), or an optax state in memory.
    target: the new layout, e.g. ``{'params': params, 'opt_state': tx.init(params)}`` or a flax
      ``TrainState`` with the loss-scaled ``tx``, holding exactly one
      :class:`~optax_dls.LossScaleState`; leaves outside its fields may be ``jax.ShapeDtypeStruct``.

  Returns:
    ``target`` with the restored values, of the same structure, dtypes and shardings.

  Raises:
    ValueError: ``target`` holds no loss-scale state or several; or ``restored`` and ``target``
      differ other than by that state (a leaf on one side only, or of another shape; listed).
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
  """Where the target leaf at ``path`` is stored: the inner state of the loss-scale state at
  ``prefix`` one level up; None for that state's own fields."""
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


def from_dynamic_scale(source: Any, target: Any) -> Any:
  """``target`` with the loss scale and growth count of a flax ``DynamicScale``.

  ``scale`` becomes the loss scale and ``fin_steps`` every ``growth_tracker`` in the policy state.
  Under ``optax_dls.config.preset("flax", ...)`` of the same settings the scale then moves exactly
  as flax's would (:func:`optax_dls.dynamic_loss_scale` grows one step earlier). A ``TrainState``
  checkpoint restored into the new state by flax's or Orbax's own code would keep the moments,
  count and scale at their initial values (:func:`optax_dls.checkpoint.restore` refuses it);
  restore it raw and convert it::

      raw = flax.training.checkpoints.restore_checkpoint(directory, target=None)
      state = optax_dls.flax.from_dynamic_scale(raw, state)

  Args:
    source: a ``DynamicScale`` or its stored dict ``{'scale', 'fin_steps'}`` (only the scale and
      growth tracker change), or the raw tree of a ``TrainState`` checkpoint with a top-level
      ``'dynamic_scale'`` beside a plain optax ``opt_state`` (every leaf restored, as
      :func:`optax_dls.checkpoint.into_loss_scaled` does). Static values: the scale in
      ``[2**-126, 2**126]``, ``fin_steps`` a whole number >= 0.
    target: an optimizer state, a ``TrainState`` built with the loss-scaled ``tx``, or any pytree
      holding exactly one :class:`optax_dls.LossScaleState`.

  Returns:
    ``target``, of the same structure and dtypes, with the new scale and growth tracker (and, for
    a checkpoint tree, every other leaf restored).

  Raises:
    TypeError: ``source`` is none of the above, its values are not static numbers, or a field of
      the target's loss-scale state is a ``jax.ShapeDtypeStruct`` (checkpoint).
    ValueError: the scale is not finite and > 0 or out of range, ``fin_steps`` < 0, ``target``
      holds no or several loss-scale states, or a checkpoint tree and ``target`` differ other than
      by the loss-scale state (leaves and shapes listed).

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls, optax_dls.flax
    >>> policy = optax_dls.config.preset("flax", growth_interval=10)
    >>> tx = optax_dls.loss_scaled(optax.adam(1e-3), policy)
    >>> state = optax_dls.flax.from_dynamic_scale({'scale': 1024.0, 'fin_steps': 7},
    ...                                           tx.init({'w': jnp.ones(2)}))
    >>> float(state.loss_scale), int(state.policy_state.growth_tracker)
    (1024.0, 7)
  """
  if isinstance(source, Mapping) and "dynamic_scale" in source:
    rest = {k: v for k, v in source.items() if k != "dynamic_scale"}
    return _ported(source["dynamic_scale"], into_loss_scaled(rest, target))
  return _ported(source, target)


def _ported(dynamic_scale: Any, opt_state: Any) -> Any:
  """``opt_state`` with the scale and growth count of ``dynamic_scale``."""
  scale, fin_steps = _dynamic_scale_fields(dynamic_scale)
  lss = _find.find_state(opt_state)
  _validation.scale("dynamic_scale.scale", scale, _validation.SCALE_MIN, _validation.SCALE_MAX)
  fin_steps = _validation.count("dynamic_scale.fin_steps", fin_steps, low=0)
  has = lambda n: hasattr(n, "growth_tracker")
  tracker = jnp.asarray(fin_steps, jnp.int32)
  grow = lambda n: n._replace(growth_tracker=tracker) if has(n) and hasattr(n, "_replace") else n
  policy_state = jax.tree.map(grow, lss.policy_state, is_leaf=has)
  new = lss._replace(loss_scale=jnp.asarray(scale, jnp.float32), policy_state=policy_state)
  return _find.replace_state(opt_state, new)


def _dynamic_scale_fields(dynamic_scale: Any) -> tuple[Any, Any]:
  if isinstance(dynamic_scale, Mapping):
    if all(k in dynamic_scale for k in ("scale", "fin_steps")):
      return dynamic_scale["scale"], dynamic_scale["fin_steps"]
  elif hasattr(dynamic_scale, "scale") and hasattr(dynamic_scale, "fin_steps"):
    return dynamic_scale.scale, dynamic_scale.fin_steps
  raise TypeError(
    "source must be a flax DynamicScale, a dict with its 'scale' and 'fin_steps', or the raw "
    "tree of a checkpoint with a 'dynamic_scale' entry (e.g. "
    "flax.training.checkpoints.restore_checkpoint(directory, target=None)), got "
    f"{repr(dynamic_scale)[:200]} of type {type(dynamic_scale).__name__}."
  )
