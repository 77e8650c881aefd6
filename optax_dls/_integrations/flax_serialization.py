"""flax's own restore into a loss-scaled target never silently resets the optimizer state.

flax restores every NamedTuple through one handler of its serialization registry, so the
handler is wrapped (once flax is imported; every other NamedTuple goes through flax's own
unchanged) to decide how a state dict is restored into a :class:`LossScaleState`:

* a state dict of the inner optimizer's state alone (a checkpoint written without loss
  scaling, e.g. ``flax.serialization.from_state_dict(target, plain_state_dict)`` or flax's
  msgpack checkpoints) is carried into ``inner_state``; the loss-scale fields keep the
  target's values (the scale at ``init_scale``, the counters at 0);
* a state dict whose inner state is the target's own arrays, which is what flax's
  ``restore_checkpoint(directory, target)`` hands over when the Orbax checkpoint holds no
  loss-scale state (Orbax keeps the target's value for every key the checkpoint lacks),
  raises a ``ValueError`` that names the conversion, instead of training on with a fresh
  optimizer state.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

from optax_dls._core.state import LossScaleState

_registered: list[bool] = []


def register() -> None:
  """Wraps flax's NamedTuple restore for :class:`LossScaleState`, once flax.serialization
  is imported; does nothing before, or when already done."""
  serialization = sys.modules.get("flax.serialization")
  if _registered or serialization is None:
    return
  kind = getattr(serialization, "_NamedTuple", None)
  registry = getattr(serialization, "_STATE_DICT_REGISTRY", {})
  if kind not in registry:  # a flax whose registry is laid out otherwise: left as it is
    return
  to_dict, from_dict = registry[kind]

  def restore(target: Any, state: Any) -> Any:
    if isinstance(target, LossScaleState):
      state = _checked(serialization, target, state)
    return from_dict(target, state)

  serialization.register_serialization_state(kind, to_dict, restore, override=True)
  _registered.append(True)


def _checked(serialization: Any, target: LossScaleState, state: Any) -> Any:
  """``state`` as a LossScaleState's state dict: a plain optimizer's carried into
  ``inner_state``; ValueError when it is the target's own inner state."""
  if not isinstance(state, dict):
    return state
  own = serialization.to_state_dict(target)
  inner = own["inner_state"]
  if set(state) != set(LossScaleState._fields):
    if isinstance(inner, dict) and set(state) == set(inner):
      return {**own, "inner_state": state}  # a checkpoint written without loss scaling
    return state  # flax's own error names the fields that differ
  leaves = jax.tree.leaves(state["inner_state"])
  fresh = int(np.max(np.asarray(jax.device_get(target.num_steps)))) == 0
  # The target's own arrays in a fresh target: what flax's restore_checkpoint hands over for
  # a checkpoint without loss scaling. A round trip of a trained state is not refused.
  if fresh and leaves and all(a is b for a, b in zip(leaves, jax.tree.leaves(inner), strict=False)):
    raise ValueError(
      "The loss-scale state (LossScaleState) came back with the target's own inner state: "
      "the checkpoint holds no loss-scale state (it was written without loss scaling, or "
      "with flax's DynamicScale beside a plain optimizer), and flax's restore_checkpoint "
      "keeps the target's value for every key a checkpoint lacks, so the optimizer state "
      "would restart from its initial values. Restore without a target and carry it over: "
      "raw = flax.training.checkpoints.restore_checkpoint(directory, target=None), then "
      "optax_dls.checkpoint.into_loss_scaled(raw, target) (or, for a DynamicScale "
      "checkpoint, optax_dls.flax.from_dynamic_scale(raw, target)); "
      "optax_dls.checkpoint.restore(directory, target) names what differs."
    )
  return state
