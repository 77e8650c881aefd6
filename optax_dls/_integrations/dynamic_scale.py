"""The port from flax's ``DynamicScale`` (public as :func:`optax_dls.flax.from_dynamic_scale`;
flax itself is not imported)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optax_dls._access import find as _find
from optax_dls._integrations.carry import into_loss_scaled
from optax_dls._util import validation as _validation


def from_dynamic_scale(source: Any, target: Any) -> Any:
  """``target`` with the loss scale and growth count of a flax ``DynamicScale``, from the
  ``DynamicScale`` itself or from a whole checkpoint of a ``TrainState`` that had one.

  Its ``scale`` becomes the loss scale and its ``fin_steps`` the growth tracker (every
  ``growth_tracker`` in the policy state). Under ``optax_dls.config.preset("flax", ...)``
  of the same settings the scale then moves exactly as flax's would
  (:func:`optax_dls.dynamic_loss_scale` of the same ``growth_interval`` grows one step
  earlier). A checkpoint of such a ``TrainState`` restored with flax's or Orbax's own code
  into the new state would leave the moments, count and scale at their initial values
  (:func:`optax_dls.checkpoint.restore` refuses it); restore it raw and convert it::

      raw = flax.training.checkpoints.restore_checkpoint(directory, target=None)
      state = optax_dls.flax.from_dynamic_scale(raw, state)

  Args:
    source: a ``DynamicScale`` or its stored dict ``{'scale', 'fin_steps'}`` (only the
      target's scale and growth tracker change), or the raw tree of a ``TrainState``
      checkpoint with a top-level ``'dynamic_scale'`` beside a plain optax ``opt_state``
      (every leaf restored, ``opt_state`` into ``inner_state`` as
      :func:`optax_dls.checkpoint.into_loss_scaled` does). The scale must lie in
      ``[2**-126, 2**126]``, ``fin_steps`` be a whole number >= 0 (static values).
    target: an optimizer state, a ``TrainState`` built with the loss-scaled ``tx``, or
      any pytree holding exactly one :class:`optax_dls.LossScaleState`.

  Returns:
    ``target``, of the same structure and dtypes, with the new scale and growth tracker
    (and, for a checkpoint tree, every other leaf restored).

  Raises:
    TypeError: ``source`` is none of the above, its values are not static numbers, or a
      field of the target's loss-scale state is a ``jax.ShapeDtypeStruct`` (checkpoint).
    ValueError: the scale is not finite and > 0 or out of range, ``fin_steps`` < 0,
      ``target`` holds no or several loss-scale states, or a checkpoint tree and
      ``target`` differ other than by the loss-scale state (leaves and shapes listed).

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
  tracker = lambda n: (
    n._replace(growth_tracker=jnp.asarray(fin_steps, jnp.int32))
    if hasattr(n, "growth_tracker") and hasattr(n, "_replace")
    else n
  )
  policy_state = jax.tree.map(
    tracker, lss.policy_state, is_leaf=lambda n: hasattr(n, "growth_tracker")
  )
  return _find.replace_state(
    opt_state, lss._replace(loss_scale=jnp.asarray(scale, jnp.float32), policy_state=policy_state)
  )


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
