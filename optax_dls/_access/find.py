"""Finding the one loss-scale state inside any optimizer state, and replacing it."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp

from optax_dls._core import accumulation as _accumulation
from optax_dls._core.state import LossScaleState


def _is_node(x: Any) -> bool:
  return isinstance(x, LossScaleState) or _accumulation.is_multisteps_state(x)


def find_all(tree: Any) -> list[LossScaleState]:
  found = []
  for leaf in jax.tree.leaves(tree, is_leaf=_is_node):
    if _accumulation.is_multisteps_state(leaf):
      if find_all(leaf.inner_opt_state):
        raise ValueError(_accumulation.MULTISTEPS_OUTSIDE)
    elif isinstance(leaf, LossScaleState):
      found.append(leaf)
      found.extend(find_all((leaf.policy_state, leaf.inner_state)))
  return found


def _unwrap(tree: Any) -> Any:
  """``tree`` with nnx ``Variable`` leaves replaced by their arrays (flax never imported)."""
  value = lambda x: x.get_value() if hasattr(x, "get_value") else x.value
  return jax.tree.map(lambda x: value(x) if is_variable(x) else x, tree, is_leaf=is_variable)


def find_state(opt_state: Any) -> LossScaleState:
  """Returns the one :class:`LossScaleState` inside ``opt_state``.

  Args:
    opt_state: the state or any pytree holding it: an ``optax.chain`` or loss-scaled
      ``optax.MultiSteps`` state, a dict, a flax ``TrainState``, an ``nnx.Optimizer`` or its
      ``opt_state``.

  Returns:
    That :class:`LossScaleState` (``nnx.Variable`` leaves as arrays); ``opt_state`` is unchanged.

  Raises:
    ValueError: no or several loss-scale states in ``opt_state``, or one in ``optax.MultiSteps``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax.chain(optax_dls.dynamic_loss_scale(optax.adam(1e-3)), optax.scale(0.5))
    >>> float(optax_dls.find_state(tx.init({'w': jnp.ones(2)})).loss_scale)
    32768.0
  """
  found = find_all(opt_state)
  if not found:
    raise ValueError(
      "opt_state holds no LossScaleState: pass the state of an optimizer built with "
      "optax_dls.dynamic_loss_scale / static_loss_scale / no_loss_scale / loss_scaled, "
      f"got a {type(opt_state).__name__}. A plain optax state (the inner optimizer's "
      "alone, or one restored from a checkpoint written without loss scaling) goes inside "
      "with optax_dls.checkpoint.into_loss_scaled(old_state, tx.init(params))."
    )
  if len(found) > 1:
    raise ValueError(
      f"opt_state holds {len(found)} LossScaleStates, so which scale to use is ambiguous: "
      "wrap the optimizer once, at the outside, or pass the sub-state you mean."
    )
  return _unwrap(found[0])


def replace_state(opt_state: Any, new: LossScaleState) -> Any:
  """``opt_state`` with its :class:`LossScaleState` replaced by ``new``, in the old dtypes."""

  def put(node: Any) -> Any:
    if not isinstance(node, LossScaleState):
      return node
    old_leaves, treedef = jax.tree.flatten(node, is_leaf=is_variable)
    return jax.tree.unflatten(
      treedef, [_like(o, n) for o, n in zip(old_leaves, jax.tree.leaves(new))]
    )

  return jax.tree.map(put, opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))


def is_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _like(old: Any, new: Any) -> Any:
  """``new`` in ``old``'s place: same dtype, and same wrapper if any."""
  dtype = jnp.result_type(jax.tree.leaves(old)[0])
  return jax.tree.unflatten(jax.tree.structure(old), [jnp.asarray(new, dtype)])
