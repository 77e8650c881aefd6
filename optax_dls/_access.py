"""Finding the loss-scale state anywhere inside an optimizer state, and reading it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_dls import _validation as v
from optax_dls._policy import SCALE_MAX, SCALE_MIN
from optax_dls._state import LossScaleState


def _is_ours(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def _find_all(tree: Any) -> list[LossScaleState]:
  found = []
  for leaf in jax.tree.leaves(tree, is_leaf=_is_ours):
    if _is_ours(leaf):
      found.append(leaf)
      found.extend(_find_all((leaf.policy_state, leaf.inner_state)))
  return found


def find_state(opt_state: Any) -> LossScaleState:
  """Returns the one :class:`LossScaleState` inside ``opt_state``.

  ``opt_state`` may be the state itself or any pytree holding it: an
  ``optax.chain`` state, a ``MultiStepsState``, a dict, a flax ``TrainState``.

  Raises:
    ValueError: there is no loss-scale state in ``opt_state``, or more than one.
  """
  found = _find_all(opt_state)
  if not found:
    raise ValueError(
        "opt_state holds no LossScaleState: pass the state of an optimizer built with "
        "optax_dls.dynamic_loss_scale / static_loss_scale / no_loss_scale / loss_scaled, "
        f"got a {type(opt_state).__name__}.")
  if len(found) > 1:
    raise ValueError(
        f"opt_state holds {len(found)} LossScaleStates, so which scale to use is ambiguous: "
        "wrap the optimizer once, at the outside, or pass the sub-state you mean.")
  return found[0]


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale S: a float32 ``()`` array (stays on the device).

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.
  """
  return find_state(opt_state).loss_scale


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """Multiplies ``loss`` by the current loss scale S, before differentiation.

  Micikevicius et al. (2018), *Mixed Precision Training*: scaling the loss
  scales every gradient by S, lifting small fp16 gradients out of the
  underflow range. The optimizer built by :func:`dynamic_loss_scale` divides
  them by the same S.

  Args:
    loss: a floating array of any shape (usually the scalar loss, float32).
      bfloat16 and float16 losses are promoted to float32 so that the scaled
      value cannot overflow their range.
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Returns:
    ``loss * S`` with dtype ``promote_types(loss.dtype, float32)``.

  Raises:
    TypeError: ``loss`` is not floating point.
    ValueError: none or more than one loss-scale state in ``opt_state``.
  """
  scale = loss_scale(opt_state)
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss must be a floating-point array, got dtype {loss.dtype}.")
  dtype = jnp.promote_types(loss.dtype, jnp.float32)
  return loss.astype(dtype) * scale.astype(dtype)


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """What the loss scaler did, as a dict of 0-d arrays (no host transfer).

  Keys:
    ``loss_scale`` (float32): the scale for the next loss.
    ``skipped`` (bool): whether the last step was skipped.
    ``skip_count`` (int32): skipped steps so far.
    ``consecutive_skips`` (int32): skipped steps since the last applied one.
    ``num_steps`` (int32): updates so far, skipped included.
    ``update_ratio`` (float32): applied steps over all steps (1 before any).
    ``grad_norm`` (float32): global L2 norm of the last step's unscaled
      gradients (NaN before the first step).

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.
  """
  s = find_state(opt_state)
  steps = s.num_steps.astype(jnp.float32)
  applied = steps - s.num_skipped.astype(jnp.float32)
  return {
      "loss_scale": s.loss_scale,
      "skipped": ~s.last_step_finite,
      "skip_count": s.num_skipped,
      "consecutive_skips": s.consecutive_skips,
      "num_steps": s.num_steps,
      "update_ratio": jnp.where(steps > 0, applied / jnp.maximum(steps, 1.0), 1.0),
      "grad_norm": s.grad_norm,
  }


def reset_scale(opt_state: Any, value: float) -> Any:
  """Returns ``opt_state`` with the loss scale set to ``value``.

  The growth tracker of the built-in policies restarts at 0; every other
  field, the inner state included, is kept.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.
    value: the new loss scale, a number or float32 ``()`` array in
      [2**-126, 2**126]. A traced array is allowed (no range check then).

  Raises:
    ValueError: ``value`` out of range, or none or more than one loss-scale
      state in ``opt_state``.
  """
  find_state(opt_state)
  if not isinstance(value, jax.core.Tracer):
    value = v.real("value", value)
    v.check(SCALE_MIN <= value <= SCALE_MAX, "value", value, "2**-126 <= value <= 2**126")

  def reset(x):
    if not _is_ours(x):
      return x
    ps = x.policy_state
    if hasattr(ps, "growth_tracker") and hasattr(ps, "_replace"):
      ps = ps._replace(growth_tracker=jnp.zeros_like(ps.growth_tracker))
    return x._replace(loss_scale=jnp.asarray(value, jnp.float32), policy_state=ps)

  return jax.tree.map(reset, opt_state, is_leaf=_is_ours)
