"""The core: unscale -> check -> skip or apply -> policy.update."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_dls import _accumulation, _multi_device, _numerics, _policies, _skip
from optax_dls._state import LossScaleState, advance, init_state, with_scale


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation with loss scaling, and its fused step.

  It is an ``optax.GradientTransformationExtraArgs`` (``init``, ``update``),
  usable wherever optax expects one. It also carries

  * ``fused_step(grads, state, params, **extra_args) -> (new_params,
    new_state)``: the update and ``optax.apply_updates`` in one, which
    :func:`apply_step` calls;
  * ``back_off(grads, state) -> (finite, state)``: the check of ``update`` on
    (scaled) ``grads`` and, when they are not finite, ``state`` with the
    policy's move for that overflow (the scale to recompute at), which
    :func:`value_and_grad` calls. ``state`` is this transformation's
    :class:`LossScaleState`; nothing else in it changes.
  """

  def __new__(cls, init: Callable, update: Callable, fused_step: Callable, back_off: Callable):
    tx = super().__new__(cls, init, update)
    tx.fused_step, tx.back_off = fused_step, back_off
    return tx


# A pytree of its four functions, so that whoever rebuilds it from its leaves (as
# some flax releases do with an ``nnx.Optimizer``'s ``tx``) keeps the last two.
_FIELDS = ("init", "update", "fused_step", "back_off")
jax.tree_util.register_pytree_with_keys(
  LossScaledTransformation,
  lambda tx: (tuple((jax.tree_util.GetAttrKey(f), getattr(tx, f)) for f in _FIELDS), None),
  lambda _, children: LossScaledTransformation(*children),
  flatten_func=lambda tx: (tuple(getattr(tx, f) for f in _FIELDS), None),
)


def loss_scaled(
  inner: optax.GradientTransformation,
  policy: _policies.LossScalePolicy,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
) -> LossScaledTransformation:
  """Wraps ``inner`` with loss scaling driven by ``policy``.

  One ``update(grads, state, params=None, **extra_args)`` does, with S the
  loss scale the loss was multiplied by (Micikevicius et al. 2018, *Mixed
  Precision Training*):

  1. unscale: ``u = grads * (1/S)`` in float32 (float64 for float64 leaves),
     cast back to each leaf's dtype; integer, bool and ``None`` leaves pass
     through untouched;
  2. check: ``finite`` when S is a valid scale (finite, > 0) and every
     floating entry of ``u`` is finite (exact), reduced over ``axis_name``;
  3. skip or apply: if finite, ``inner.update(u, inner_state, params,
     **extra_args)``; otherwise the updates are zeros of exactly the type the
     applied step returns (structure, dtype, sharding) and ``inner_state`` is
     returned unchanged (bit for bit, or widened where the inner optimizer
     widens its own state), so its step count and learning-rate schedule do
     not advance, and the inner optimizer never sees a non-finite value;
  4. ``policy.update`` moves S for the next loss, kept within the policy's
     ``[min_scale, max_scale]``. A loss scale that is not valid (NaN, inf,
     0, negative: a corrupted checkpoint, a misbehaving policy) skips the
     step and comes back as the policy's initial scale.

  No host synchronisation. The state's types are a fixed point from ``init``
  on (no retrace after the first step).

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

  Returns:
    A :class:`LossScaledTransformation` whose state is a :class:`LossScaleState`.

  Raises:
    TypeError: ``inner`` is not an optax transformation, ``policy`` is not a
      usable :class:`LossScalePolicy`, ``axis_name`` is not a string or tuple
      of strings, or ``skip_lowering`` is not a string.
    ValueError: ``skip_lowering`` is not one of the three, or the policy's
      scales are out of range. At trace time, under ``shard_map`` (with
      ``check_vma=True``), when the gradients vary over a mesh axis that
      ``axis_name`` leaves out, or ``axis_name`` names an axis that is not
      mapped where ``update`` runs.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.loss_scaled(optax.sgd(1.0), optax_dls.static_policy(4.0))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([4.0, jnp.inf])}, state)
    >>> updates['w'], bool(state.last_step_finite)
    (Array([0., 0.], dtype=float32), False)
  """
  inner = optax.with_extra_args_support(_accumulation.check_inner(inner))
  policy = _policies.check_policy(policy)
  axis_name = _multi_device.check_axis_name(axis_name)
  skip = _skip.lowering(skip_lowering)
  if policy.passthrough:
    return _passthrough(inner, policy, axis_name, skip)
  init_scale = policy.init()[0]

  def init_fn(params):
    scale, policy_state = policy.init()
    return init_state(
      scale, (policy.min_scale, policy.max_scale), policy_state, _skip.settled_init(inner, params)
    )

  def step(grads, state, params, extra_args, out, skipped):
    _check_state(state)
    _multi_device.check_axis_coverage(_numerics.float_leaves(grads), state.loss_scale, axis_name)
    # Check: one fused read of the scaled gradients; false for an invalid scale.
    finite, grad_norm = skip.check(grads, state.loss_scale, axis_name)
    # Unscale, inside the skip so it fuses with the optimizer; 0 on a skipped step.
    inv_scale = jnp.where(finite, 1.0 / state.loss_scale, 0.0)

    def apply(g, inner_state, p):
      updates, inner_state = inner.update(
        _numerics.unscale(g, inv_scale), inner_state, p, **extra_args
      )
      return out(p, updates), inner_state

    result, inner_state = skip.select(finite, apply, skipped, grads, state.inner_state, params)
    new_scale, policy_state = policy_step(grads, state, finite, grad_norm)
    return result, advance(state, finite, grad_norm, new_scale, policy_state, inner_state)

  def policy_step(grads, state, finite, grad_norm):
    """``policy.update`` on this step's statistics; an invalid scale is replaced by the initial one."""
    valid = _numerics.valid_scale(state.loss_scale)
    amax = _numerics.global_amax(grads, axis_name) if "amax" in policy.stats else None
    stats = _policies.GradStats(finite, state.num_steps, grad_norm, amax)
    new_scale, policy_state = policy.update(
      jnp.where(valid, state.loss_scale, init_scale), state.policy_state, stats
    )
    return jnp.where(valid, new_scale, init_scale), policy_state

  def back_off(grads, state):
    """The check of ``update``; on an overflow, the policy's move: the state to recompute at."""
    _check_state(state)
    finite, grad_norm = skip.check(grads, state.loss_scale, axis_name)
    new_scale, policy_state = policy_step(grads, state, finite, grad_norm)
    keep = lambda old, new: jnp.where(finite, old, new)
    return finite, with_scale(
      state, keep(state.loss_scale, new_scale), jax.tree.map(keep, state.policy_state, policy_state)
    )

  def update_fn(grads, state, params=None, **extra_args):
    return step(grads, state, params, extra_args, _skip.updates_out, _skip.updates_skipped)

  def fused_step(grads, state, params, **extra_args):
    return step(grads, state, params, extra_args, _skip.params_out, _skip.params_skipped)

  return LossScaledTransformation(init_fn, update_fn, fused_step, back_off)


def _passthrough(
  inner: optax.GradientTransformationExtraArgs,
  policy: _policies.LossScalePolicy,
  axis_name: Any,
  skip: _skip.Lowering,
) -> LossScaledTransformation:
  """The transformation of a ``passthrough`` policy (S = 1): gradients go to
  ``inner`` unchanged, nothing is checked or skipped; the state keeps the
  loss-scaled layout, and ``grad_norm`` is measured (without overflow)."""

  def init_fn(params):
    scale, policy_state = policy.init()
    return init_state(scale, (policy.min_scale, policy.max_scale), policy_state, inner.init(params))

  def step(grads, state, params, extra_args, out):
    _check_state(state)
    _, grad_norm = skip.check(grads, jnp.float32(1.0), axis_name)
    updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    finite = jnp.ones([], jnp.bool_)
    return out(params, updates), advance(
      state, finite, grad_norm, state.loss_scale, state.policy_state, inner_state
    )

  def back_off(grads, state):
    _check_state(state)
    return jnp.ones([], jnp.bool_), state  # nothing is checked: no overflow to back off from

  return LossScaledTransformation(
    init_fn,
    lambda grads, state, params=None, **extra: step(grads, state, params, extra, _skip.updates_out),
    lambda grads, state, params, **extra: step(grads, state, params, extra, _skip.params_out),
    back_off,
  )


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
    params: the parameters; required.
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
