"""``loss_scaled``: an optax ``GradientTransformationExtraArgs`` of two closures, ``init``
and ``update``; one update reads top to bottom: check, unscale, skip or apply, move the
scale, count, record."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls import _policies
from optax_dls._core import accumulation as _accumulation
from optax_dls._core import labels as _labels
from optax_dls._core import multi_device as _multi_device
from optax_dls._core import numerics as _numerics
from optax_dls._core import record as _record
from optax_dls._core import skip as _skip
from optax_dls._core.state import LossScaleState, init_state, settled_inner_init
from optax_dls._util import frames as _frames
from optax_dls._util import model as _model
from optax_dls._util import tree_paths as _tree_paths


def loss_scaled(
  inner: optax.GradientTransformation,
  policy: _policies.LossScalePolicy,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
  labels: _labels.Labels = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with loss scaling driven by ``policy``.

  One ``update(grads, state, params=None, *, loss=None, **extra_args)`` does, with S the
  loss scale the loss was multiplied by (Micikevicius et al. 2018, *Mixed Precision
  Training*):

  1. unscale: ``u = grads * (1/S)`` in float32 (float64 for float64 leaves), in each
     leaf's dtype, or in its parameter's where that is a wider real float (a float16
     gradient of a float32 parameter is unscaled into float32, so nothing the scale saved
     is flushed again); integer, bool and ``None`` leaves pass through untouched;
  2. check: ``finite`` when S is valid (finite, > 0), every floating entry of ``u`` is
     finite (exact) and the ``loss``, when given, is finite, reduced over ``axis_name``;
     a non-finite step records which leaves held an inf or a NaN and whether the loss
     did (:func:`nonfinite_leaves`, :func:`metrics`);
  3. skip or apply: if finite, ``inner.update(u, inner_state, params, **extra_args)``;
     otherwise the updates are negative zeros of the applied step's type, so that
     ``optax.apply_updates`` leaves every parameter bit for bit, and ``inner_state`` is
     returned unchanged (its step count and schedule do not advance; the inner optimizer
     never sees a non-finite value);
  4. ``policy.update`` moves S for the next loss, within ``[min_scale, max_scale]`` (a NaN
     it returns is the initial scale). A scale in the state that is not valid (NaN, inf,
     0, negative: a corrupted checkpoint) skips the step and comes back as the initial one.

  No host synchronisation. The state's types are a fixed point from ``init`` on (no
  retrace after the first step): ``init`` gives each inner state leaf the dtype and weak
  type the inner updates settle on (traced with ``jax.eval_shape``). An inner update that
  cannot be traced without its other extra arguments (``optax.lbfgs``'s ``value_fn=``)
  gets a strongly typed state, which retraces once if the optimizer widens it.

  Args:
    inner: any optax ``GradientTransformation``; ``update``'s ``**extra_args`` are
      forwarded to it. An ``optax.MultiSteps`` (gradient accumulation) is accepted as
      is: a non-finite micro-batch is dropped before it reaches the accumulator.
    policy: a :class:`LossScalePolicy`, e.g. :func:`dynamic_policy`.
    axis_name: ``None`` (default), a mapped axis name or a tuple of names. Needed under
      ``pmap`` / ``shard_map``: the finite flag and ``grad_norm`` are reduced over every
      named axis, so all devices skip together. Name every axis the gradients are sharded
      or computed over; not needed under ``jit`` with ``NamedSharding``. Under ``vmap``
      with an axis name every member shares one decision, without one each keeps its own.
    skip_lowering: ``"auto"`` (default), ``"cond"`` or ``"where"``: how the skip is
      compiled (a ``lax.cond``, or a ``jnp.where`` selection that XLA's GPU backend fuses
      into the optimizer's kernels). Both make the same decisions and scales; applied
      values and ``grad_norm`` agree to float32 rounding (so may the scale of a policy
      that reads the norm). ``"auto"`` takes ``"cond"`` on the CPU, else ``"where"``.
    labels: ``None`` (default), or parameter-group labels as in :func:`underflow_stats`
      (a pytree of non-empty strings without ``/`` matching the parameters or a prefix,
      or a callable ``params -> such a pytree``): the state then counts, per label, the
      non-finite steps in which a leaf of that group was not finite (:func:`metrics`'
      ``overflows/<label>``), e.g. LoRA adapters against base weights.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (``init``, ``update``: two closures, as
    optax's own transformations are) whose state is a :class:`LossScaleState`.

  Raises:
    TypeError: ``inner`` is not an optax transformation, ``policy`` is not a usable
      :class:`LossScalePolicy`, ``axis_name`` is not a string or tuple of strings, or
      ``skip_lowering`` or a label is not a string.
    ValueError: ``skip_lowering`` is not one of the three, the policy's scales are out of
      range, or the labels are empty or malformed (at ``init``: they do not match the
      parameters, or ``inner`` is loss-scaled already). At trace time: under
      ``shard_map(check_vma=True)`` the gradients vary over a mesh axis ``axis_name`` leaves
      out, or ``axis_name`` names an axis not mapped there; or the state's policy state is
      not of this transformation's policy.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.loss_scaled(optax.sgd(1.0), optax_dls.dynamic_policy(init_scale=4.0))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([4.0, jnp.inf])}, state)
    >>> updates['w'], bool(state.last_step_finite)
    (Array([-0., -0.], dtype=float32), False)
  """
  return build(inner, policy, axis_name, skip_lowering, labels)


def build(  # noqa: C901 (the closures of one transformation)
  inner: Any, policy: Any, axis_name: Any, skip_lowering: Any, labels: Any, track: bool = True
) -> optax.GradientTransformationExtraArgs:
  """The transformation of checked arguments (``track``: whether a passthrough policy's
  update measures the gradient norm)."""
  inner = optax.with_extra_args_support(_accumulation.check_inner(inner))
  policy = _policies.check_policy(policy)
  axis_name = _multi_device.check_axis_name(axis_name)
  lowering = _skip.check_lowering(skip_lowering)
  labels = _labels.check_labels(labels, "loss_scaled")
  # Nothing kept here may be a JAX value made here: the transformation may be built inside
  # a trace (a jitted init that builds the optimizer, as flax's TrainState.create under
  # jax.jit), and a tracer of that finished trace, closed over by every update, would be
  # handed to the update's program as an extra argument that JAX's dispatch then drops.
  with jax.ensure_compile_time_eval():
    init_scale, initial = policy.init()
  init_scale = np.float32(init_scale)
  policy_def, policy_kind = jax.tree.structure(initial), type(initial).__name__
  low, high = np.float32(policy.min_scale), np.float32(policy.max_scale)
  wants_amax = "amax" in policy.stats
  told = [False]  # whether a forgotten scale_loss was warned about

  def leaf_labels(tree: Any) -> list[str]:
    return [] if labels is None else _labels.leaf_labels(labels, tree, "loss_scaled")

  def init_fn(params: Any) -> LossScaleState:
    _model.check_init_params(params)
    scale, policy_state = policy.init()
    trained = _model.trained(params)
    inner_state = inner.init(trained) if policy.passthrough else settled_inner_init(inner, trained)
    if _holds_state(inner_state):
      raise ValueError(_TWICE)
    n = len(_labels.leaf_names(params))
    return init_state(scale, policy_state, inner_state, n, leaf_labels(params))

  def passed(
    grads: Any, state: LossScaleState, params: Any, extra_args: dict
  ) -> tuple[Any, LossScaleState]:
    # No loss scaling: S is 1, or a scale restored from a scaled run, divided out once.
    valid = _numerics.valid_scale(state.loss_scale)
    inv = 1.0 / jnp.where(valid, state.loss_scale, jnp.ones_like(state.loss_scale))
    norm = state.grad_norm
    if track:
      norm = _skip.check(lowering, grads, 1.0 / inv, axis_name, False).grad_norm
    _, kept, _ = _model.held_apart(grads, params)
    unscaled = _numerics.unscale(grads, inv)
    updates, inner_state = _model.inner_update(
      inner.update, unscaled, kept, state.inner_state, **extra_args
    )
    # The new fields computed from the old ones: a constant would cost a copy per field.
    settled = lambda old, value: jnp.where(old == value, old, value)
    new = state._replace(
      loss_scale=settled(inv, 1.0),
      num_steps=optax.safe_increment(state.num_steps),
      consecutive_skips=settled(state.consecutive_skips, 0),
      grad_norm=norm,
      inner_state=inner_state,
    )
    return updates, new

  def policy_step(state: LossScaleState, finite: jax.Array, check: Any) -> tuple[Any, Any]:
    # The policy moves the scale, kept in its range; a scale that is not valid restarts.
    valid = _numerics.valid_scale(state.loss_scale)
    stats = _policies.GradStats(finite, state.num_steps, check.grad_norm, check.amax)
    scale = jnp.where(valid, state.loss_scale, init_scale)
    new_scale, policy_state = policy.update(scale, state.policy_state, stats)
    new_scale = jnp.asarray(new_scale, jnp.float32)  # a NaN from the policy restarts too
    new_scale = jnp.where(valid & ~jnp.isnan(new_scale), new_scale, init_scale)
    return jnp.clip(new_scale, low, high), policy_state

  def update_fn(
    updates: Any, state: Any, params: Any = None, *, loss: Any = None, **extra_args: Any
  ) -> tuple[Any, LossScaleState]:
    if not isinstance(state, LossScaleState):
      check_state(state)
    backing_off = isinstance(state.inner_state, BackOff)
    if policy.passthrough:  # nothing is checked, nothing to back off from
      _loss_code(loss, None)  # a loss that is not a float array refused as under scaling
      return (jnp.bool_(True), state) if backing_off else passed(updates, state, params, extra_args)
    if jax.tree.structure(state.policy_state) != policy_def:  # type: ignore[operator]
      raise ValueError(_other_policy(state, policy_kind))
    # Parameters whose gradient is None (an Equinox model's functions) and integer arrays
    # stay out of the skip and pass through untouched.
    plain = _plain(updates, params)
    held, kept, _ = (None, params, []) if plain else _model.held_apart(updates, params)
    read = _numerics.widened(updates if plain else _model.recorded(updates, params, held), params)
    loss_code = _loss_code(loss, axis_name)
    leaves = _numerics.float_leaves((read, loss))
    _multi_device.check_axis_coverage(leaves, state.loss_scale, axis_name)
    check = _skip.check(lowering, read, state.loss_scale, axis_name, wants_amax)
    if not told[0] and _unscaled(updates, state.loss_scale):
      told[0] = True
      warnings.warn(_FORGOTTEN, UserWarning, stacklevel=_frames.user_stacklevel())
    # The record: each leaf's code, the loss's (or the one a recomputation left for this
    # very step) and the step's number; the step is finite when all are 0.
    step = optax.safe_increment(state.num_steps)
    left = jnp.where(state.nonfinite[-1] == step, state.nonfinite[-2], 0)
    loss_code = jnp.maximum(loss_code, left)
    finite = check.finite & (loss_code == 0)
    codes = [_leaf_codes(state, check, backing_off), jnp.stack([loss_code, step])]
    record = jnp.where(finite, state.nonfinite, jnp.concatenate(codes))
    new_scale, policy_state = policy_step(state, finite, check)
    if backing_off:  # a recomputation's check: the scale moves only
      keep = lambda old, new: jnp.where(finite, old, new)
      moved = jax.tree.map(keep, (state.loss_scale, state.policy_state), (new_scale, policy_state))
      return finite, state._replace(loss_scale=moved[0], policy_state=moved[1], nonfinite=record)
    overflows = state.overflows
    if labels is not None or overflows:
      masks = {} if labels is None else _record.group_masks(leaf_labels(read))
      if set(masks) != set(overflows):  # a state of another labels= (restored)
        raise ValueError(_other_labels(state, masks))
      overflows = _record.counted(overflows, finite, check.codes, masks)
    inv = jnp.where(finite, 1.0 / state.loss_scale, 0.0)  # unscaled inside the skip: fused

    def apply(g: Any, inner_state: Any, p: Any) -> tuple[Any, Any]:
      unscaled = _numerics.unscale(g, inv, p)
      if plain:
        out, new = inner.update(unscaled, inner_state, p, **extra_args)
      else:
        out, new = _model.inner_update(inner.update, unscaled, p, inner_state, **extra_args)
      return out, jax.tree.map(_skip.as_weak_as, new, inner_state)

    out, inner_state = _skip.skipped(lowering, finite, apply, updates, state.inner_state, kept)
    return out, LossScaleState(
      loss_scale=new_scale,
      num_steps=step,
      num_skipped=jnp.where(finite, state.num_skipped, optax.safe_increment(state.num_skipped)),
      consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
      grad_norm=check.grad_norm,
      nonfinite=record,
      overflows=overflows,
      policy_state=policy_state,
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class BackOff(NamedTuple):
  """In place of ``inner_state``: ``update`` then only checks, returning ``(finite, state)``
  with the scale moved and the record (:func:`optax_dls.value_and_grad`'s tries)."""


def _leaf_codes(state: LossScaleState, check: _numerics.Check, backing_off: bool) -> jax.Array:
  """The record's code of each parameter leaf; ValueError for gradients of other parameters,
  but in a recomputation's check (of several arguments, say), whose leaves it names none."""
  num_leaves = state.nonfinite.shape[0] - 2
  if check.codes.shape[0] == num_leaves:
    return check.codes.astype(jnp.int32)
  if not backing_off:
    raise ValueError(_other_params(state, check))
  return jnp.zeros([num_leaves], jnp.int32)


def _plain(grads: Any, params: Any) -> bool:
  """Whether every leaf of ``grads`` and ``params`` is a floating array: none to hold out."""
  none = lambda x: x is None
  leaves = jax.tree.leaves((grads, () if params is None else params), is_leaf=none)
  return all(hasattr(x, "dtype") and _numerics.is_float(x) for x in leaves)


def _loss_code(loss: Any, axis_name: Any) -> jax.Array:
  """int32 ``()``: 2 when ``loss`` holds a NaN, 1 an infinity, 0 otherwise or when not
  given; the same on every device of ``axis_name``. TypeError naming ``loss`` unless it is
  None or a real floating array."""
  if loss is None:
    return jnp.zeros([], jnp.int32)
  try:
    value = None if isinstance(loss, (str, bytes, dict)) else jnp.asarray(loss)
  except (TypeError, ValueError):
    value = None
  if value is None or not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
      f"loss must be None or a real floating-point array (the loss of this step), got "
      f"{loss!r} of type {type(loss).__name__}."
    )
  code = jnp.where(jnp.any(jnp.isnan(value)), 2, jnp.where(jnp.all(jnp.isfinite(value)), 0, 1))
  return _multi_device.pmax(code.astype(jnp.int32), axis_name)


_TWICE = (
  "inner is already loss-scaled (its state holds a LossScaleState): the gradients would be "
  "unscaled twice. Wrap the optimizer once, e.g. dynamic_loss_scale(optax.chain(clip, adam))."
)


_FORGOTTEN = (
  "optax_dls: no gradient this update receives depends on the loss scale in opt_state: the "
  "loss was not multiplied by optax_dls.scale_loss(loss, opt_state) before differentiation, "
  "so each update divides unscaled gradients by the scale (Adam hides it, SGD stalls). "
  "Return optax_dls.scale_loss(loss, opt_state) from the function you differentiate, or use "
  "optax_dls.value_and_grad(loss_fn, tx) (optax_dls.flax.value_and_grad for a TrainState or "
  "an nnx.Optimizer), which multiplies it."
)


def _unscaled(grads: Any, scale: Any) -> bool:
  """Whether the gradients were computed in the trace the scale is an argument of and none
  depends on the scale (the loss was not multiplied by it); False whenever JAX's records
  (the tracers' ``parent`` equations) tell nothing."""
  trace = getattr(scale, "_trace", None)
  parent = lambda x: getattr(x, "parent", None)
  computed = lambda g: getattr(g, "_trace", None) is trace and parent(g) is not None
  leaves = [g for g in jax.tree.leaves(grads) if computed(g) and _numerics.is_float(g)]
  if trace is None or not leaves:
    return False
  roots: set[int] = set()
  root = lambda x: roots.add(id(x)) if parent(x) is None else None
  root(scale)  # the arguments the scale is computed from (itself, for a state's own)
  if _walk([scale], root) is None:
    return False
  return _walk(leaves, lambda x: id(x) in roots) is False


def _walk(start: list[Any], hit: Any, limit: int = 1_000_000) -> bool | None:
  """True at the first input ``hit`` accepts back from ``start``, False at none, None if long."""
  stack, seen = list(start), set()
  while stack:
    eqn = getattr(stack.pop(), "parent", None)
    if eqn is None or id(eqn) in seen:
      continue
    seen.add(id(eqn))
    inputs = getattr(eqn, "in_tracers", None)
    if inputs is None or len(seen) > limit:
      return None
    if any(hit(x) for x in inputs):
      return True
    stack.extend(inputs)
  return False


def _other_policy(state: LossScaleState, kind: str) -> str:
  return (
    f"opt_state's policy state ({type(state.policy_state).__name__}) is not of this "
    f"transformation's policy, which keeps a {kind}: the state was built, or restored, "
    "under another policy (amax_policy, fp32_fallback or a policy of your own differ "
    "from the dynamic rule). Build the state with this transformation "
    "(tx.init(params)), or keep only the optimizer's state: "
    "optax_dls.checkpoint.into_loss_scaled(old.inner_state, tx.init(params))."
  )


def _other_labels(state: LossScaleState, masks: dict) -> str:
  return (
    f"opt_state counts overflows for the parameter groups {sorted(state.overflows) or 'none'}, "
    f"and this transformation labels {sorted(masks) or 'none'} (labels=): the state was built "
    "by a transformation with other labels. Build the state with this one (tx.init(params)), "
    "or restore it into a target built by it and carry only the inner state over "
    "(optax_dls.checkpoint.into_loss_scaled(restored.inner_state, tx.init(params)))."
  )


def _other_params(state: LossScaleState, check: _numerics.Check) -> str:
  return (
    f"opt_state records {state.nonfinite.shape[0] - 2} floating gradient leaves and this "
    f"update receives {check.codes.shape[0]}: the state was built (tx.init) for other "
    "parameters. Build it with tx.init(params) for the parameters these gradients are of."
  )


def is_loss_scaled(tx: Any) -> bool:
  """Whether ``tx`` is a transformation :func:`loss_scaled` built (its ``update`` is this
  module's closure)."""
  update = getattr(tx, "update", None)
  return getattr(update, "__qualname__", "") == "build.<locals>.update_fn" and (
    getattr(update, "__module__", None) == __name__
  )


def _holds_state(tree: Any) -> bool:
  """Whether ``tree`` holds a :class:`LossScaleState` somewhere."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LossScaleState))
  return any(isinstance(x, LossScaleState) for x in leaves)


def check_state(state: Any) -> None:
  """TypeError, saying what to do, unless ``state`` is a :class:`LossScaleState`."""
  if isinstance(state, LossScaleState):
    return
  if _holds_state(state):
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
