"""The port from flax's ``DynamicScale``: its scale and growth count into a loss-scale state,
or a checkpoint of a ``TrainState`` with a ``dynamic_scale`` field into the ported state.

Public as :func:`optax_dls.flax.from_dynamic_scale`; flax itself is not imported.
"""

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

  For a port from ``flax.training.dynamic_scale.DynamicScale``: its ``scale``
  becomes the loss scale and its ``fin_steps`` (finite steps since the last
  growth or overflow) the growth tracker of the built-in policies (every
  ``growth_tracker`` in the policy state). With ``optax_dls.config.preset("flax",
  ...)`` of the DynamicScale's own settings (``growth_factor``,
  ``backoff_factor``, ``growth_interval``, ``minimum_scale``), as
  ``optax_dls.loss_scaled(inner, optax_dls.config.preset("flax",
  growth_interval=...))``, the scale then moves exactly as flax's would have:
  flax grows on the ``growth_interval + 1``-th consecutive finite step.
  :func:`optax_dls.dynamic_loss_scale` of the same ``growth_interval`` grows one
  step earlier.

  ``source`` is one of:

  * a ``DynamicScale``, or the dict flax's and Orbax's checkpoints restore it
    as, ``{'scale': ..., 'fin_steps': ...}``: only the scale and the growth
    tracker of ``target`` change, every other field is kept;
  * the raw tree of a checkpoint of a flax ``TrainState`` that had a
    ``dynamic_scale`` field beside a plain optax ``opt_state`` (dicts and lists
    of arrays with a top-level ``'dynamic_scale'`` entry, as restored without a
    target): every leaf of ``target`` is restored. The old ``opt_state`` goes
    to the loss-scale state's ``inner_state``
    (:func:`optax_dls.checkpoint.into_loss_scaled`), every other field to its
    place, and ``dynamic_scale`` to the loss scale and growth tracker; nothing
    is left at its initial value silently.

  A port of a flax example from ``DynamicScale`` to
  :func:`optax_dls.dynamic_loss_scale` changes the layout: restored with flax's
  or Orbax's own code into the new state, such a checkpoint would leave the
  optimizer's moments, its count and the loss scale at their initial values
  (:func:`optax_dls.checkpoint.restore` refuses it). Restore it raw and
  convert it instead::

      raw = flax.training.checkpoints.restore_checkpoint(directory, target=None)
      # or, with Orbax: raw = manager.restore(step)
      state = optax_dls.flax.from_dynamic_scale(raw, state)

  Args:
    source: a ``DynamicScale``, its dict, or a raw checkpoint tree, as above.
      The scale must lie in ``[2**-126, 2**126]`` (the next update keeps it
      within the policy's range); ``fin_steps`` must be a whole number of steps >= 0 (static
      values).
    target: an optimizer state, a ``TrainState`` built with the loss-scaled
      ``tx``, or any pytree holding exactly one
      :class:`optax_dls.LossScaleState`; for a checkpoint tree it gives the
      layout, dtypes and shardings.

  Returns:
    ``target``, of the same structure and dtypes, with the new scale and growth
    tracker (and, for a checkpoint tree, every other leaf restored).

  Raises:
    TypeError: ``source`` is none of the above (no ``scale`` and ``fin_steps``,
      nor a ``'dynamic_scale'`` entry), they are not static numbers, or a
      field of ``target``'s loss-scale state is a ``jax.ShapeDtypeStruct``
      (checkpoint tree).
    ValueError: the scale is not finite and > 0 or lies outside that range,
      ``fin_steps`` < 0, ``target`` holds none or several loss-scale states,
      or a checkpoint tree and ``target`` differ other than by the loss-scale
      state (the message lists the leaves and shapes).

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
  """``opt_state`` with the scale and growth count of ``dynamic_scale`` (a ``DynamicScale``
  or its dict)."""
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
  """``(scale, fin_steps)`` of a ``DynamicScale`` or of its stored dict."""
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
