"""The core: check -> unscale -> skip or apply -> policy.update.

:class:`LossScaler` holds one loss-scaled transformation's definition (the inner
transformation, the policy, the axis names, the lowering) and its four
functions; :class:`LossScaledTransformation` is the optax transformation that
carries them. Everything optional composes around this: policies and policy
wrappers own the scale, transformations chained inside own their statistics,
and host-side code reads :func:`optax_dls.metrics`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls import (
  _accumulation,
  _flax_serialization,
  _labels,
  _localisation,
  _lowering,
  _model,
  _multi_device,
  _numerics,
  _policies,
  _types,
)
from optax_dls._state import (
  LossScaleState,
  advance,
  init_state,
  settled_inner_init,
  settled_scale,
  with_scale,
)


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
  del out
  return params  # bit for bit


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
    self.init_scale = policy.init()[0]
    self.scale_range = (policy.min_scale, policy.max_scale)

  def init(self, params: Any) -> LossScaleState:
    """The state before the first step (see :func:`loss_scaled`)."""
    _model.check_init_params(params)
    _flax_serialization.register()  # flax's own restore into this state: carried or refused
    scale, policy_state = self.policy.init()
    names = _labels.leaf_names(params)
    labels = [] if self.labels is None else self._leaf_labels(params)
    record = _localisation.init_record(names, labels)
    return init_state(scale, policy_state, self._inner_init(params), record)

  def _inner_init(self, params: Any) -> Any:
    return settled_inner_init(self.inner, params)

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
    new_scale, policy_state = self._policy_step(grads, state, finite, check.grad_norm)
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
    check, loss_bad, finite = self._check(_numerics.widened(grads, params), state, loss)
    # Unscale inside the skip, so that it fuses with the optimizer; 0 on a skipped step.
    inv_scale = jnp.where(finite, 1.0 / state.loss_scale, 0.0)

    # Parameters whose gradient is None (an Equinox model's functions and other non-array
    # leaves) stay out of the skip's operands and outputs and pass through untouched.
    held = _model.held_out(grads, params)
    kept, static = (params, []) if held is None else _model.split(grads, params, held)
    whole = (lambda p: p) if held is None else (lambda p: _model.merge(grads, p, held, static))

    def apply(g: Any, inner_state: Any, p: Any) -> tuple[Any, Any]:
      p = whole(p)
      unscaled = _numerics.unscale(g, inv_scale, p)
      updates, new_state = self.inner.update(unscaled, inner_state, p, **extra_args)
      out = output.out(p, updates)
      if held is not None and output is PARAMS:
        out = _model.without(grads, out, held)
      return out, jax.tree.map(_types.as_weak_as, new_state, inner_state)

    select = self.lowering.select
    result, inner_state = select(finite, apply, output.skipped, grads, state.inner_state, kept)
    if held is not None and output is PARAMS:
      result = whole(result)
    new_scale, policy_state = self._policy_step(grads, state, finite, check.grad_norm)
    record = self._record(grads, state, check, finite, loss_bad)
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
    _check_state(state)
    loss = checked_loss(loss)
    leaves = _numerics.float_leaves(grads) + ([] if loss is None else [loss])
    _multi_device.check_axis_coverage(leaves, state.loss_scale, self.axis_name)
    check = self.lowering.check(grads, state.loss_scale, self.axis_name)
    loss_bad = _loss_not_finite(loss, self.axis_name) | _pending_loss(state)
    return check, loss_bad, check.finite & ~loss_bad

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
        "(state = tx.init(params)._replace(inner_state=restored.inner_state))."
      )
    step = optax.safe_increment(state.num_steps)
    return _localisation.recorded(
      state.nonfinite, finite, step, check.nonfinite, check.nan, loss_bad, masks
    )

  def _leaf_labels(self, tree: Any) -> list[str]:
    return _labels.leaf_labels(self.labels, tree, "loss_scaled")

  def _policy_step(
    self, grads: Any, state: LossScaleState, finite: jax.Array, grad_norm: jax.Array
  ) -> tuple[jax.Array, Any]:
    """``policy.update`` on this step's statistics; an invalid scale restarts at the initial one."""
    valid = _numerics.valid_scale(state.loss_scale)
    wants_amax = "amax" in self.policy.stats
    amax = _numerics.global_amax(grads, self.axis_name) if wants_amax else None
    stats = _policies.GradStats(finite, state.num_steps, grad_norm, amax)
    scale = jnp.where(valid, state.loss_scale, self.init_scale)
    new_scale, policy_state = self.policy.update(scale, state.policy_state, stats)
    return jnp.where(valid, new_scale, self.init_scale), policy_state


class PassthroughScaler(LossScaler):
  """The transformation of a ``passthrough`` policy (S = 1 by construction): gradients go
  to ``inner`` unchanged, nothing is checked or skipped, and the inner state is exactly
  what ``inner`` makes it (so the result is the bare ``inner``'s bit for bit); the state
  keeps the loss-scaled layout, its scale 1 after every update (a state restored from
  another transformation is settled to 1 by ``checkpoint.restore``, or by its first
  update). ``grad_norm`` is measured only when asked for."""

  passthrough = True

  def __init__(self, *args: Any, track_grad_norm: bool = False) -> None:
    super().__init__(*args)
    self.track_grad_norm = track_grad_norm

  def _inner_init(self, params: Any) -> Any:
    return self.inner.init(params)

  def back_off(
    self, grads: Any, state: Any, *, loss: Any = None
  ) -> tuple[jax.Array, LossScaleState]:
    _check_state(state)
    # Nothing is checked: no overflow to back off from. The scale is 1, as after any update.
    return jnp.ones([], jnp.bool_), settled_scale(state)

  def _step(
    self, grads: Any, state: Any, params: Any, loss: Any, extra_args: dict, output: _Output
  ) -> tuple[Any, LossScaleState]:
    _check_state(state)
    norm = state.grad_norm
    if self.track_grad_norm:
      norm = self.lowering.check(grads, jnp.float32(1.0), self.axis_name).grad_norm
    updates, inner_state = self.inner.update(grads, state.inner_state, params, **extra_args)
    finite = jnp.ones([], jnp.bool_)
    one = jnp.ones([], jnp.float32)
    new = advance(
      state, finite, norm, state.nonfinite, one, state.policy_state, inner_state, self.scale_range
    )
    return output.out(params, updates), new


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation with loss scaling, and its fused step.

  It is an ``optax.GradientTransformationExtraArgs`` (``init``, ``update``),
  usable wherever optax expects one, and an ordinary Python object: it copies,
  deep-copies, pickles (where its inner transformation's and policy's
  functions do) and rebuilds from its two fields. Its ``update`` is the method
  of a ``LossScaler`` (the private object that holds the definition: inner
  transformation, policy, axis names, lowering), which also gives it

  * ``fused_step(grads, state, params, **extra_args) -> (new_params,
    new_state)``: the update and ``optax.apply_updates`` in one, which
    :func:`apply_step` calls;
  * ``back_off(grads, state, *, loss=None) -> (finite, state)``: the check of
    ``update`` on (scaled) ``grads`` and, when they are not finite, ``state``
    with the policy's move for that overflow (the scale to recompute at),
    which :func:`value_and_grad` calls;
  * ``passthrough``: True when the scale is 1 by construction
    (:func:`no_loss_scale`): nothing is checked, and the loss need not be
    multiplied by the scale.

  They stay with the ``update`` they belong to through ``copy``,
  ``_replace(init=...)`` and any rebuilding; an ``update`` replaced by another
  function has none (None, False).
  """

  @property
  def scaler(self) -> LossScaler | None:
    """The ``LossScaler`` whose ``update`` this is, or None (an ``update`` replaced by
    another function)."""
    owner = getattr(self.update, "__self__", None)
    return owner if isinstance(owner, LossScaler) else None

  @property
  def fused_step(self) -> Callable[..., tuple[Any, Any]] | None:
    """``update`` and ``optax.apply_updates`` in one, or None without a ``LossScaler``.

    ``fused_step(grads, state, params, *, loss=None, **extra_args) -> (new_params,
    new_state)``, as :func:`apply_step` calls it.
    """
    return None if self.scaler is None else self.scaler.fused_step

  @property
  def back_off(self) -> Callable[..., tuple[jax.Array, Any]] | None:
    """The check and the policy's move for an overflow, or None without a ``LossScaler``.

    ``back_off(grads, state, *, loss=None) -> (finite, state)``, ``finite`` a bool
    ``()``, as :func:`value_and_grad` calls it.
    """
    return None if self.scaler is None else self.scaler.back_off

  @property
  def passthrough(self) -> bool:
    """Whether the loss scale is 1 by construction (:func:`no_loss_scale`)."""
    return self.scaler is not None and self.scaler.passthrough


def transformation(scaler: LossScaler) -> LossScaledTransformation:
  """The optax transformation carrying ``scaler``'s functions."""
  return LossScaledTransformation(scaler.init, scaler.update)


def loss_scaled(
  inner: optax.GradientTransformation,
  policy: _policies.LossScalePolicy,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
  labels: _labels.Labels = None,
) -> LossScaledTransformation:
  """Wraps ``inner`` with loss scaling driven by ``policy``.

  One ``update(grads, state, params=None, *, loss=None, **extra_args)`` does, with S the
  loss scale the loss was multiplied by (Micikevicius et al. 2018, *Mixed
  Precision Training*):

  1. unscale: ``u = grads * (1/S)`` in float32 (float64 for float64 leaves),
     cast to each leaf's dtype, or to its parameter's where ``params`` are given
     and the parameter is a wider real float (a float16 or bfloat16 gradient of a
     float32 parameter is unscaled into float32, so the updates have the
     parameter's dtype and nothing the scale saved is flushed again); a gradient
     as narrow as its parameter, or with ``params=None``, keeps its own dtype;
     integer, bool and ``None`` leaves pass through untouched;
  2. check: ``finite`` when S is a valid scale (finite, > 0), every
     floating entry of ``u`` is finite (exact) and, when ``loss`` is given,
     the loss is finite too, reduced over ``axis_name``; a non-finite step
     records which gradient leaves held an inf or a NaN and whether the loss
     was not finite (:func:`nonfinite_leaves`, :func:`metrics`);
  3. skip or apply: if finite, ``inner.update(u, inner_state, params,
     **extra_args)``; otherwise the updates are negative zeros of exactly the
     type the applied step returns (structure, dtype, sharding), so that
     ``optax.apply_updates`` leaves every parameter bit for bit (``-0.0``
     included; integer leaves get plain zeros), and ``inner_state`` is
     returned unchanged (bit for bit, or widened where the inner optimizer
     widens its own state), so its step count and learning-rate schedule do
     not advance, and the inner optimizer never sees a non-finite value;
  4. ``policy.update`` moves S for the next loss, kept within the policy's
     ``[min_scale, max_scale]``. A loss scale that is not valid (NaN, inf,
     0, negative: a corrupted checkpoint, a misbehaving policy) skips the
     step and comes back as the policy's initial scale.

  No host synchronisation. The state's types are a fixed point from ``init``
  on (no retrace after the first step): ``init`` gives each inner state leaf
  the dtype the inner updates settle on and their weak or strong type (traced
  with ``jax.eval_shape``, an update that needs the loss given a float32
  ``value=``). The one exception is an inner update that cannot be traced
  without its other extra arguments (``value_fn=`` of ``optax.lbfgs``'s line
  search, say): the state is made strongly typed, and a state such an
  optimizer widens on its first update retraces once.

  Args:
    inner: any optax ``GradientTransformation``; ``**extra_args`` of
      ``update`` are forwarded to it. An ``optax.MultiSteps`` (gradient
      accumulation) is accepted as is: a non-finite micro-batch is then
      dropped before it reaches the accumulator.
    policy: a :class:`LossScalePolicy`, e.g. :func:`dynamic_policy`.
    axis_name: ``None`` (default), a mapped axis name or a tuple of names.
      Needed under ``pmap`` / ``shard_map``: the finite flag is reduced over
      every named axis so that all devices skip together, and ``grad_norm``
      becomes the same on every device. Name every axis the gradients are
      sharded or computed over. Not needed under ``jit`` with
      ``NamedSharding``. Under ``vmap`` with an axis name every member shares
      one decision; without one each member keeps its own scale.
    skip_lowering: ``"auto"`` (default), ``"cond"`` or ``"where"``: how the
      skip is compiled (a ``lax.cond``, or a ``jnp.where`` selection fused
      into the optimizer's elementwise work). Both make the same skip
      decisions and scales; applied values agree to float32 rounding (some
      entries may differ in the last bit); ``"auto"`` takes ``"where"``'s skip
      with ``"cond"``'s one-read check on the CPU, and ``"where"`` on every
      other platform (see ``docs/design.md``).
    labels: ``None`` (default), or parameter-group labels as in
      :func:`underflow_stats` (a pytree of strings matching the parameters, or
      a prefix of them, or a callable ``params -> such a pytree``; non-empty,
      without ``/``): the state then counts, per label, the non-finite steps in
      which some leaf of that group was not finite (:func:`metrics` reports
      them as ``overflows/<label>``), e.g. LoRA adapters against base weights.

  Returns:
    A :class:`LossScaledTransformation` whose state is a :class:`LossScaleState`.

  Raises:
    TypeError: ``inner`` is not an optax transformation, ``policy`` is not a
      usable :class:`LossScalePolicy`, ``axis_name`` is not a string or tuple
      of strings, ``skip_lowering`` is not a string, or a label is not a string.
    ValueError: ``skip_lowering`` is not one of the three, the policy's
      scales are out of range, or the labels are empty or malformed (at
      ``init``: they do not match the parameters). At trace time, under ``shard_map`` (with
      ``check_vma=True``), when the gradients vary over a mesh axis that
      ``axis_name`` leaves out, or ``axis_name`` names an axis that is not
      mapped where ``update`` runs.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.loss_scaled(optax.sgd(1.0), optax_dls.static_policy(4.0))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([4.0, jnp.inf])}, state)
    >>> updates['w'], bool(state.last_step_finite)
    (Array([-0., -0.], dtype=float32), False)
  """
  return transformation(build_scaler(inner, policy, axis_name, skip_lowering, labels))


def _without_extra_args(
  update: Callable[..., Any], updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> Any:
  del extra_args
  return update(updates, state, params)


def _with_extra_args(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` taking ``**extra_args`` (dropped where it takes none), as
  ``optax.with_extra_args_support`` does, and as picklable as ``inner`` is."""
  if isinstance(inner, optax.GradientTransformationExtraArgs):
    return inner
  return optax.GradientTransformationExtraArgs(
    inner.init, functools.partial(_without_extra_args, inner.update)
  )


def build_scaler(
  inner: Any, policy: Any, axis_name: Any, skip_lowering: Any, labels: Any, **options: Any
) -> LossScaler:
  """The :class:`LossScaler` of checked arguments (a :class:`PassthroughScaler` for a
  passthrough policy, which takes ``options``)."""
  inner = _with_extra_args(_accumulation.check_inner(inner))
  policy = _policies.check_policy(policy)
  axis_name = _multi_device.check_axis_name(axis_name)
  lowering = _lowering.lowering(skip_lowering)
  labels = _labels.check_labels(labels, "loss_scaled")
  kind = PassthroughScaler if policy.passthrough else LossScaler
  return kind(inner, policy, axis_name, lowering, labels, **options)


def checked_loss(loss: Any) -> jax.Array | None:
  """``loss`` as an array (None stays None): a real floating-point array of any shape (the
  loss of this step, or its per-example values); TypeError naming it otherwise."""
  if loss is None:
    return None
  try:
    value = None if isinstance(loss, (str, bytes, dict)) else jnp.asarray(loss)
  except (TypeError, ValueError):
    value = None
  if value is None or not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
      f"loss must be None or a real floating-point array (the loss of this step), got "
      f"{loss!r} of type {type(loss).__name__}."
    )
  return value


def _loss_not_finite(loss: Any, axis_name: Any) -> jax.Array:
  """bool ``()``: whether ``loss`` (an array, or None: not given) has an entry that is not
  finite, reduced over ``axis_name``."""
  if loss is None:
    return jnp.zeros([], jnp.bool_)
  bad = jnp.any(~jnp.isfinite(loss)).astype(jnp.int32)
  return _multi_device.pmax(bad, axis_name) > 0


def _pending_loss(state: LossScaleState) -> jax.Array:
  """bool ``()``: whether the record says the loss of the step about to run was not finite
  (left by :func:`value_and_grad`, which checks the loss before ``update`` sees the
  gradients): that step is skipped as if the loss had been handed to ``update``."""
  record = state.nonfinite
  return record.loss & (record.step == optax.safe_increment(state.num_steps))


def _check_state(state: Any) -> None:
  if not isinstance(state, LossScaleState):
    raise TypeError(
      f"opt_state must be the state this loss-scaled transformation's init returned (a "
      f"LossScaleState), got a {type(state).__name__}: {repr(state)[:200]}."
    )


def apply_step(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
  **extra_args: Any,
) -> tuple[Any, Any]:
  """One optimizer step returning new parameters: ``update`` and ``apply_updates`` fused.

  Equivalent to::

      updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
      params = optax.apply_updates(params, updates)

  but for a :class:`LossScaledTransformation` (what :func:`loss_scaled`,
  :func:`dynamic_loss_scale`, ... return) the updates are applied *inside*
  the skip, by the transformation's own ``fused_step``: XLA then fuses them
  with the inner optimizer's arithmetic, as it does for a bare optimizer. The
  result equals the two calls up to the rounding of the fused arithmetic
  (within an ulp or so). On a skipped step the parameters come back bit for
  bit. Any other transformation runs the two calls above; when its state
  holds a loss-scale state (a loss-scaled transformation inside
  ``optax.chain``, say), a ``UserWarning`` says at trace time that the fused
  form is lost.

  Args:
    tx: the optax transformation, usually loss-scaled.
    grads: the (scaled) gradients, a pytree matching ``params``.
    opt_state: ``tx``'s state.
    params: the parameters; required. A parameter whose gradient is ``None``
      (an Equinox model's functions and other leaves that are not arrays, as
      ``eqx.filter_grad`` gives them) is returned as it is, on every step.
    **extra_args: forwarded to ``tx.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Raises:
    TypeError: ``tx`` is not an optax transformation, ``params`` is None, or
      ``opt_state`` is not ``tx``'s state.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> params, state = optax_dls.apply_step(tx, {'w': jnp.full(2, 4.0)}, state, params)
    >>> params['w']
    Array([0.5, 0.5], dtype=float32)
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
      f"tx must be an optax.GradientTransformation, got {tx!r} of type {type(tx).__name__}."
    )
  if params is None:
    raise TypeError("apply_step needs params (the parameters to update), got params=None.")
  fused = getattr(tx, "fused_step", None)
  if fused is not None:
    return fused(grads, opt_state, params, **extra_args)
  if any(
    isinstance(x, LossScaleState)
    for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))
  ):
    warnings.warn(
      "apply_step: tx has no fused step but its state holds a LossScaleState (a loss-scaled "
      "transformation wrapped in another one, e.g. optax.chain); running tx.update and "
      "optax.apply_updates instead. Call apply_step on the loss-scaled transformation itself "
      "(put it outermost) to keep the fused form.",
      stacklevel=2,
    )
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  return optax.apply_updates(params, updates), opt_state
