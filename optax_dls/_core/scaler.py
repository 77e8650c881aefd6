"""The core's one step: check -> unscale -> skip or apply -> policy.update -> record.

:class:`LossScaler` holds one loss-scaled transformation's definition (the inner
transformation, the policy, the axis names, the lowering, the labels) and its four
functions (``init``, ``update``, ``fused_step``, ``back_off``), which the
:class:`~optax_dls.LossScaledTransformation` of ``transform.py`` carries. Everything
optional composes around this: policies and policy wrappers own the scale,
transformations chained inside own their statistics, and host-side code reads
:func:`optax_dls.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls import _policies
from optax_dls._core import forgotten as _forgotten
from optax_dls._core import labels as _labels
from optax_dls._core import lowering as _lowering
from optax_dls._core import multi_device as _multi_device
from optax_dls._core import numerics as _numerics
from optax_dls._core import record as _localisation
from optax_dls._core import types as _types
from optax_dls._core.loss import checked_loss, loss_not_finite, pending_loss
from optax_dls._core.state import (
  ON_INIT,
  LossScaleState,
  advance,
  init_state,
  settled_inner_init,
  with_scale,
)
from optax_dls._util import model as _model
from optax_dls._util import tree_paths as _tree_paths


class _Output(NamedTuple):
  """What a step returns: ``out(params, updates)``, or ``skipped(params, out)`` on a
  skipped step."""

  out: Callable[[Any, Any], Any]
  skipped: Callable[[Any, Any], Any]


def _updates(params: Any, updates: Any) -> Any:
  del params
  return updates


def _skipped_updates(params: Any, out: Any) -> Any:
  del params
  return jax.tree.map(_types.negative_zeros_like, out)


def _applied(params: Any, updates: Any) -> Any:
  """``optax.apply_updates``, leaving a parameter whose update is None as it is."""
  return jax.tree.map(
    lambda p, u: p if u is None else optax.apply_updates(p, u),
    params,
    updates,
    is_leaf=lambda x: x is None,
  )


def _skipped_params(params: Any, out: Any) -> Any:
  """The parameters bit for bit, in the applied step's sharding where that differs on
  ``Explicit`` axes (replicated parameters whose updates are sharded, as with a sharded
  optimizer state)."""
  keep = lambda p, o: p if p is None or o is None else _multi_device.shard_like(p, o)
  return jax.tree.map(keep, params, out, is_leaf=lambda x: x is None)


UPDATES = _Output(_updates, _skipped_updates)  # tx.update
PARAMS = _Output(_applied, _skipped_params)  # apply_step: updates applied inside


class LossScaler:
  """One loss-scaled transformation: its definition and its ``init``, ``update``,
  ``fused_step`` and ``back_off``. Built by :func:`loss_scaled`; its methods are
  what a :class:`LossScaledTransformation` carries."""

  passthrough = False

  def __init__(
    self,
    inner: optax.GradientTransformationExtraArgs,
    policy: _policies.LossScalePolicy,
    axis_name: str | tuple[str, ...] | None,
    lowering: _lowering.Lowering,
    labels: _labels.Labels,
  ) -> None:
    self.inner, self.policy, self.axis_name = inner, policy, axis_name
    self.lowering, self.labels = lowering, labels
    # Nothing this object keeps may be a JAX value made here. The transformation may be
    # built inside a trace (a jitted init that builds the optimizer, as flax's
    # TrainState.create does under jax.jit): a value made there is a tracer of that trace,
    # and every update closing over it would hand JAX a tracer of a finished trace as a
    # constant. JAX passes it to the update's program as an extra argument, which its
    # dispatch fast path then leaves out: the second call of a jitted step fails
    # ("Execution supplied N arguments but compiled program expected N+k") or crashes.
    # So policy.init() runs eagerly, and the initial scale is kept as a NumPy float32.
    with jax.ensure_compile_time_eval():
      init_scale, initial = policy.init()
    self.init_scale = np.float32(init_scale)
    # What this policy's state looks like: a state of another policy is refused by it.
    self.policy_state_def = jax.tree.structure(initial)
    self.policy_state_type = type(initial).__name__
    self.scale_range = (policy.min_scale, policy.max_scale)
    self.told_unscaled = [False]  # whether a forgotten scale_loss was warned about

  def init(self, params: Any) -> LossScaleState:
    """The state before the first step (see :func:`loss_scaled`)."""
    _model.check_init_params(params)
    for hook in ON_INIT:  # e.g. flax's own restore into this state: carried or refused
      hook()
    scale, policy_state = self.policy.init()
    names = _labels.leaf_names(params)
    labels = [] if self.labels is None else self._leaf_labels(params)
    record = _localisation.init_record(names, labels)
    return init_state(scale, policy_state, self._inner_init(params), record)

  def _inner_init(self, params: Any) -> Any:
    return settled_inner_init(self.inner, _model.trained(params))

  def update(
    self, grads: Any, state: Any, params: Any = None, *, loss: Any = None, **extra_args: Any
  ) -> tuple[Any, LossScaleState]:
    """``(updates, state)``: one loss-scaled step (see :func:`loss_scaled`)."""
    return self._step(grads, state, params, loss, extra_args, UPDATES)

  def fused_step(
    self, grads: Any, state: Any, params: Any, *, loss: Any = None, **extra_args: Any
  ) -> tuple[Any, LossScaleState]:
    """``(new_params, state)``: ``update`` and ``optax.apply_updates`` in one, the
    updates applied inside the skip (:func:`apply_step`)."""
    return self._step(grads, state, params, loss, extra_args, PARAMS)

  def back_off(
    self, grads: Any, state: Any, *, loss: Any = None
  ) -> tuple[jax.Array, LossScaleState]:
    """The check of ``update`` on the (scaled) ``grads``; when they (or ``loss``) are
    not finite, ``state`` with the policy's move for that overflow (the scale to
    recompute at) and the record of where it came from. Nothing else changes."""
    check, loss_bad, finite = self._check(grads, state, loss)
    new_scale, policy_state = self._policy_step(state, finite, check)
    keep = lambda old, new: jnp.where(finite, old, new)
    record = self._record(grads, state, check, finite, loss_bad)
    moved = with_scale(
      state,
      keep(state.loss_scale, new_scale),
      jax.tree.map(keep, state.policy_state, policy_state),
      self.scale_range,
    )
    return finite, moved._replace(nonfinite=record)

  def _step(
    self, grads: Any, state: Any, params: Any, loss: Any, extra_args: dict, output: _Output
  ) -> tuple[Any, LossScaleState]:
    # Parameters whose gradient is None (an Equinox model's functions and other non-array
    # leaves) stay out of the skip's operands and outputs and pass through untouched.
    held, kept, static = _model.held_apart(grads, params)
    read = _model.recorded(grads, params, held)  # a floating parameter's None grad as zeros
    check, loss_bad, finite = self._check(_numerics.widened(read, params), state, loss)
    _forgotten.warn_if_unscaled(grads, state.loss_scale, self.told_unscaled)
    # Unscale inside the skip, so that it fuses with the optimizer; 0 on a skipped step.
    inv_scale = jnp.where(finite, 1.0 / state.loss_scale, 0.0)

    whole = (lambda p: p) if held is None else (lambda p: _model.merge(grads, p, held, static))

    def apply(g: Any, inner_state: Any, p: Any) -> tuple[Any, Any]:
      # The inner optimizer sees the parameters as Equinox hands them to optax
      # (eqx.filter(model, eqx.is_array)): None at the held-out places, no functions as
      # operands of its own conditionals (optax.MultiSteps).
      unscaled = _numerics.unscale(g, inv_scale, p)
      updates, new_state = _model.inner_update(
        self.inner.update, unscaled, p, inner_state, **extra_args
      )
      out = output.out(whole(p), updates)
      if held is not None and output is PARAMS:
        out = _model.without(grads, out, held)
      return out, jax.tree.map(_types.as_weak_as, new_state, inner_state)

    select = self.lowering.select
    result, inner_state = select(finite, apply, output.skipped, grads, state.inner_state, kept)
    if held is not None and output is PARAMS:
      result = whole(result)
    new_scale, policy_state = self._policy_step(state, finite, check)
    record = self._record(read, state, check, finite, loss_bad)
    new = advance(
      state, finite, check.grad_norm, record, new_scale, policy_state, inner_state, self.scale_range
    )
    return result, new

  def _check(
    self, grads: Any, state: Any, loss: Any
  ) -> tuple[_numerics.Check, jax.Array, jax.Array]:
    """The lowering's check of the scaled gradients, whether the loss was not finite (handed
    over as ``loss=``, or recorded for this step by :func:`value_and_grad`), and the step's
    finite flag (false for either)."""
    check_state(state)
    self.check_policy_state(state)
    loss = checked_loss(loss)
    leaves = _numerics.float_leaves(grads) + ([] if loss is None else [loss])
    _multi_device.check_axis_coverage(leaves, state.loss_scale, self.axis_name)
    wants_amax = "amax" in self.policy.stats
    check = self.lowering.check(grads, state.loss_scale, self.axis_name, wants_amax)
    loss_bad = loss_not_finite(loss, self.axis_name) | pending_loss(state)
    return check, loss_bad, check.finite & ~loss_bad

  def check_policy_state(self, state: LossScaleState) -> None:
    """ValueError when ``state``'s policy state is not of this transformation's policy (a
    state built, or restored, under another policy), before anything reads it."""
    if jax.tree.structure(state.policy_state) != self.policy_state_def:  # type: ignore[operator]
      raise ValueError(
        f"opt_state's policy state ({type(state.policy_state).__name__}) is not of this "
        f"transformation's policy, which keeps a {self.policy_state_type}: the "
        "state was built, or restored, under another policy (amax_policy, fp32_fallback, "
        "skips_at_min_scale or a policy of your own differ from the dynamic rule). Build the "
        "state with this transformation (tx.init(params)), or keep only the optimizer's "
        "state: optax_dls.checkpoint.into_loss_scaled(old.inner_state, tx.init(params))."
      )

  def _record(
    self,
    grads: Any,
    state: LossScaleState,
    check: _numerics.Check,
    finite: jax.Array,
    loss_bad: jax.Array,
  ) -> _localisation.NonFiniteRecord:
    masks = {} if self.labels is None else _localisation.group_masks(self._leaf_labels(grads))
    if set(masks) != set(state.nonfinite.overflows):  # a state of another labels= (restored)
      raise ValueError(
        f"opt_state counts overflows for the parameter groups "
        f"{sorted(state.nonfinite.overflows) or 'none'}, and this transformation labels "
        f"{sorted(masks) or 'none'} (labels=): the state was built by a transformation with "
        "other labels. Build the state with this one (tx.init(params)), or restore it into "
        "a target built by it and carry only the inner state over "
        "(optax_dls.checkpoint.into_loss_scaled(restored.inner_state, tx.init(params)))."
      )
    step = optax.safe_increment(state.num_steps)
    return _localisation.recorded(
      state.nonfinite, finite, step, check.nonfinite, check.nan, loss_bad, masks
    )

  def _leaf_labels(self, tree: Any) -> list[str]:
    return _labels.leaf_labels(self.labels, tree, "loss_scaled")

  def _policy_step(
    self, state: LossScaleState, finite: jax.Array, check: _numerics.Check
  ) -> tuple[jax.Array, Any]:
    """``policy.update`` on this step's statistics (the check's, the largest magnitude
    included where the policy asks for it); an invalid scale restarts at the initial one."""
    valid = _numerics.valid_scale(state.loss_scale)
    stats = _policies.GradStats(finite, state.num_steps, check.grad_norm, check.amax)
    scale = jnp.where(valid, state.loss_scale, self.init_scale)
    new_scale, policy_state = self.policy.update(scale, state.policy_state, stats)
    return jnp.where(valid, new_scale, self.init_scale), policy_state


def check_state(state: Any) -> None:
  if isinstance(state, LossScaleState):
    return
  inside = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, LossScaleState))
  if any(isinstance(x, LossScaleState) for x in inside):
    raise TypeError(
      f"opt_state must be this transformation's own state (the LossScaleState its init "
      f"returned), got a {type(state).__name__} holding one: pass that state itself (a "
      "TrainState's opt_state, say), or call the transformation that wraps this one."
    )
  named = jax.tree.leaves(state, is_leaf=_tree_paths.is_namedtuple)
  kinds = list(dict.fromkeys(type(x).__name__ for x in named))  # in their order
  held = ", ".join(kinds[:4]) or "no state"
  raise TypeError(
    f"opt_state must be the state this loss-scaled transformation's init returned (a "
    f"LossScaleState), got a {type(state).__name__} (holding {held}): a plain optax "
    "state, built by the inner optimizer alone or restored from a checkpoint written "
    "without loss scaling? Put it inside with "
    "optax_dls.checkpoint.into_loss_scaled(old_state, tx.init(params))."
  )
