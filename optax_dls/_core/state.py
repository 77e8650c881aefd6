"""The loss-scale state: one NamedTuple of fixed-dtype arrays around the inner state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls._core import types as _types
from optax_dls._core.record import NonFiniteRecord


class LossScaleState(NamedTuple):
  """State of a loss-scaled optimizer, kept inside the optax ``opt_state``.

  Every field except ``nonfinite``, ``policy_state`` and ``inner_state`` is a
  0-d JAX array with the dtype given below, so the state flattens, jits,
  scans, shards (replicated) and checkpoints like any optax state.
  The state holds only what was learned (the scale, the counters, the
  record, the policy's and the inner optimizer's states), never how the
  transformation was built: its policy, scale range and kind are static and
  closed over by the transformation, which applies them at every update. A
  state restored into another transformation (dynamic, static, no-op, other
  settings) therefore trains under that transformation's rule from its first
  update, which unscales by the restored scale the loss was multiplied by
  (``no_loss_scale`` too) and then applies the rule
  (``optax_dls.checkpoint.restore(..., tx=tx)`` settles it before; see the
  checkpoints guide).

  Attributes:
    loss_scale: float32 ``()``. The scale S to multiply the *next* loss by;
      each update leaves it within its policy's ``[min_scale, max_scale]``
      (1 under a no-op policy; a NaN from a misbehaving policy stays NaN until
      the next step skips and restarts at the initial scale).
    num_steps: int32 ``()``. Number of ``update`` calls so far, skipped steps
      included. Saturates at ``2**31 - 1`` instead of wrapping.
    num_skipped: int32 ``()``. Number of skipped (non-finite) steps so far.
      Saturating.
    consecutive_skips: int32 ``()``. Skipped steps since the last applied
      step; reset to 0 by a finite step. Saturating.
    last_step_finite: bool ``()``. Whether the last step was applied (True
      before the first step).
    grad_norm: float32 ``()``. Global L2 norm of the unscaled gradients of the
      last step (inf or NaN when they were not finite; NaN before the first step);
      under ``pmap`` / ``shard_map`` with ``axis_name``, the norm over every
      device and the same on each (see ``docs/multi_device.md``).
    nonfinite: the record of the last non-finite step, a ``NonFiniteRecord``
      of ``step`` (int32 ``()``, its update number; 0 before any),
      ``leaves`` and ``nan`` (uint32 ``[W]``, one bit per floating gradient
      leaf: not finite, and held a NaN), ``loss`` (bool ``()``, the loss was
      not finite) and ``overflows`` (a dict of int32 ``()`` per parameter-group
      label, empty without labels). Read it with :func:`optax_dls.metrics`
      and :func:`optax_dls.nonfinite_leaves`.
    policy_state: pytree of the loss-scale policy (for the dynamic policy a
      ``DynamicScaleState`` of ``growth_tracker`` and ``hysteresis_left``).
    inner_state: the wrapped optax transformation's state; bit-for-bit
      unchanged by a skipped step.
  """

  loss_scale: jax.Array
  num_steps: jax.Array
  num_skipped: jax.Array
  consecutive_skips: jax.Array
  last_step_finite: jax.Array
  grad_norm: jax.Array
  nonfinite: NonFiniteRecord
  policy_state: Any
  inner_state: Any

  def __getattr__(self, name: str) -> Any:
    # Only for a name the state lacks: code that read the wrapped optimizer's state
    # directly (opt_state.gradient_step of a MultiStepsState) is told where it went.
    if name.startswith("__"):
      raise AttributeError(name)
    raise AttributeError(
      f"'LossScaleState' object has no attribute {name!r}: the wrapped optimizer's state "
      f"is its inner_state (optax_dls.find_state(opt_state).inner_state), or find a leaf "
      f"by name with optax.tree_utils.tree_get(opt_state, {name!r})."
    )


# Called with no arguments at every ``init``, before the state is built: an integration
# (flax's restore into this state, ``_integrations``) registers itself here, so that the
# core imports none of them and one registered late still runs.
ON_INIT: list[Callable[[], None]] = []


def init_state(
  loss_scale: Any,
  policy_state: Any,
  inner_state: Any,
  nonfinite: NonFiniteRecord,
) -> LossScaleState:
  """Builds the state before the first step, with every field at its fixed dtype.

  Each field is its own buffer, so the state can be donated to a jitted step.
  """
  return LossScaleState(
    loss_scale=jnp.array(loss_scale, jnp.float32),
    num_steps=jnp.zeros([], jnp.int32),
    num_skipped=jnp.zeros([], jnp.int32),
    consecutive_skips=jnp.zeros([], jnp.int32),
    last_step_finite=jnp.ones([], jnp.bool_),
    grad_norm=jnp.full([], jnp.nan, jnp.float32),
    nonfinite=nonfinite,
    policy_state=jax.tree.map(jnp.array, policy_state),
    inner_state=inner_state,
  )


# Updates traced at init to find the inner state's settled dtypes: optimizers that
# widen over several updates (optax.contrib.prodigy on float16 parameters) settle
# within two or three.
_SETTLE_TRIES = 4


def settled_inner_init(inner: optax.GradientTransformationExtraArgs, params: Any) -> Any:
  """``inner.init(params)`` in the types the inner state keeps from then on, so that
  the loss-scaled state's types are a fixed point from ``init`` (no retrace, and a
  ``lax.scan`` carry keeps its type).

  Each leaf is given the type the inner updates give it: the dtype they widen it to
  and the strong type where they return it strongly typed (traced with
  ``jax.eval_shape``, repeated until the types stop changing); values are unchanged
  (widening is exact). An update that needs the loss as ``value=``
  (``optax.contrib.momo``, ``reduce_on_plateau``) is traced with a float32 ``()`` one.
  Where the inner update cannot be traced without its other extra arguments
  (``value_fn=`` of ``optax.lbfgs``'s line search, say), the leaves are only made
  strongly typed, as updates return them: a state that such an optimizer widens on
  its first update then retraces once.
  """
  state = jax.tree.map(_as_array, inner.init(params))
  for _ in range(_SETTLE_TRIES):
    try:
      after = _updated_state(inner, state, params)
    except Exception:  # noqa: BLE001 (an update that needs other extra arguments)
      return jax.tree.map(_types.strong, state)
    if jax.tree.structure(after) != jax.tree.structure(state):  # type: ignore[operator]
      return jax.tree.map(_types.strong, state)
    settled = jax.tree.map(_types.like, state, after)
    if _types_of(settled) == _types_of(state):
      return settled
    state = settled
  return state


def _as_array(x: Any) -> Any:
  """A leaf of the inner ``init``'s state as ``jit`` returns it: a Python or NumPy
  scalar becomes an array (a Python one weakly typed, as ``jit`` gives it back)."""
  if isinstance(x, (bool, int, float, complex, np.generic)) and not isinstance(x, jax.Array):
    return jnp.asarray(x)
  return x


def _updated_state(inner: optax.GradientTransformationExtraArgs, state: Any, params: Any) -> Any:
  """The inner state's types after one update, traced: without extra arguments, or,
  where the update fails without one, with the loss as ``value``."""
  try:
    return jax.eval_shape(inner.update, params, state, params)[1]
  except Exception as without_value:  # noqa: BLE001 (TypeError or the optimizer's own error)
    value = jax.ShapeDtypeStruct((), jnp.float32)
    try:
      return jax.eval_shape(lambda s, p, v: inner.update(p, s, p, value=v), state, params, value)[1]
    except Exception:  # noqa: BLE001
      raise without_value from None


def _types_of(tree: Any) -> list[Any]:
  return [(getattr(x, "dtype", None), _types.weak(x)) for x in jax.tree.leaves(tree)]


def with_scale(
  state: LossScaleState,
  loss_scale: jax.Array,
  policy_state: Any,
  scale_range: tuple[float, float],
) -> LossScaleState:
  """``state`` with a new scale (kept within ``scale_range``, the transformation's
  ``[min_scale, max_scale]``) and policy state."""
  low, high = (np.float32(x) for x in scale_range)
  return state._replace(
    loss_scale=jnp.clip(jnp.asarray(loss_scale, jnp.float32), low, high),
    policy_state=policy_state,
  )


def settled_scale(state: LossScaleState) -> LossScaleState:
  """``state`` with the scale 1 of a passthrough transformation (``no_loss_scale``)."""
  return state._replace(loss_scale=jnp.ones_like(state.loss_scale))


def passed(
  state: LossScaleState, inv_scale: jax.Array, grad_norm: jax.Array, inner_state: Any
) -> LossScaleState:
  """The state after a passthrough update (``no_loss_scale``), which unscaled the gradients
  by ``inv_scale``: the scale 1, one more step, none skipped, the new ``grad_norm`` and
  inner state; the record and the policy state as they were. (What :func:`advance` makes
  of a finite step at the scale 1, its values computed from the state, not constants.)"""
  return state._replace(
    # From the factor, which is computed from the old scale: the new scale's write into
    # the old one's buffer then comes after every read of it, without a copy.
    loss_scale=_settled(inv_scale, 1.0),
    num_steps=optax.safe_increment(state.num_steps),
    consecutive_skips=_settled(state.consecutive_skips, 0),
    last_step_finite=_settled(state.last_step_finite, True),
    grad_norm=grad_norm,
    inner_state=inner_state,
  )


def _settled(old: jax.Array, value: Any) -> jax.Array:
  """``value``, of ``old``'s type, computed from ``old`` (``old`` where it already is
  ``value``). A constant would not do as a field of the new state: XLA copies a constant
  into an output's buffer (a kernel each on a GPU, two where the buffer is donated), and
  JAX leaves a field the step does not read out of the program, so that its donated
  buffer goes unused and the outputs of its type take the other fields' donated buffers
  (one more copy)."""
  return jnp.where(old == value, old, value)


def advance(
  state: LossScaleState,
  finite: jax.Array,
  grad_norm: jax.Array,
  nonfinite: NonFiniteRecord,
  loss_scale: jax.Array,
  policy_state: Any,
  inner_state: Any,
  scale_range: tuple[float, float],
) -> LossScaleState:
  """The state after one update: the new scale (kept in ``scale_range``), policy and inner
  states, the record of where a non-finite step came from, and the step counters
  moved by whether the step was ``finite``."""
  return with_scale(state, loss_scale, policy_state, scale_range)._replace(
    num_steps=optax.safe_increment(state.num_steps),
    num_skipped=jnp.where(finite, state.num_skipped, optax.safe_increment(state.num_skipped)),
    consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
    last_step_finite=finite,
    grad_norm=grad_norm,
    nonfinite=nonfinite,
    inner_state=inner_state,
  )
