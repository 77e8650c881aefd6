"""The optax wrapper: unscale -> check -> inner.update -> skip -> policy.update."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_dls import _numerics, _policy
from optax_dls._state import LossScaleState, init_state


def _check_axis_name(axis_name: Any) -> Any:
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if isinstance(axis_name, (tuple, list)) and axis_name and all(isinstance(a, str) for a in axis_name):
    return tuple(axis_name)
  raise TypeError(f"axis_name must be None, a string or a non-empty tuple of strings, got {axis_name!r}.")


def loss_scaled(
    inner: optax.GradientTransformation,
    policy: _policy.LossScalePolicy,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with loss scaling driven by ``policy``.

  One ``update(grads, state, params=None, **extra_args)`` does, with S the
  loss scale the loss was multiplied by:

  1. unscale: ``u = grads * (1/S)`` in float32 (float64 for float64 leaves),
     cast back to each leaf's dtype; integer, bool and ``None`` leaves pass
     through untouched;
  2. ``finite``: every floating entry of ``u`` is finite (exact), reduced over
     ``axis_name`` when given;
  3. if finite, ``inner.update(u, inner_state, params, **extra_args)``;
     otherwise the updates are zeros (the shapes and dtypes the inner
     transformation would return) and ``inner_state`` is returned bit-for-bit
     unchanged, so its step count and learning-rate schedule do not advance;
  4. ``policy.update`` moves S for the next loss.

  No host synchronisation: the skip is a ``lax.cond`` inside the update.
  Method: Micikevicius et al. (2018), *Mixed Precision Training*.

  Args:
    inner: any optax ``GradientTransformation``; ``**extra_args`` of
      ``update`` are forwarded to it.
    policy: a :class:`LossScalePolicy`, e.g. :func:`dynamic_policy`.
    axis_name: ``None`` (default), a mapped axis name or a tuple of names.
      Needed under ``pmap`` / ``shard_map``: the finite flag is reduced over
      every named axis so that all devices skip together. Not needed under
      ``jit`` with ``NamedSharding``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: ``inner`` is not an optax transformation, ``policy`` is not a
      :class:`LossScalePolicy`, or ``axis_name`` is not a string or tuple of
      strings.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {inner!r} of type {type(inner).__name__}.")
  policy = _policy.check_policy(policy)
  axis_name = _check_axis_name(axis_name)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    scale, policy_state = policy.init()
    return init_state(scale, policy_state, inner.init(params))

  def update_fn(grads, state, params=None, **extra_args):
    if policy.passthrough:
      updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
      return updates, state._replace(
          num_steps=optax.safe_increment(state.num_steps),
          grad_norm=_numerics.global_norm(grads),
          inner_state=inner_state)

    scale = state.loss_scale
    inv_scale = (1.0 / scale).astype(jnp.float32)
    unscaled = _numerics.unscale(grads, inv_scale)
    finite = _numerics.all_finite(unscaled, axis_name)

    def apply(operands):
      u, inner_state = operands
      return inner.update(u, inner_state, params, **extra_args)

    def skip(operands):
      u, inner_state = operands
      shapes = jax.eval_shape(apply, operands)[0]
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      return zeros, inner_state

    updates, inner_state = lax.cond(finite, apply, skip, (unscaled, state.inner_state))

    stats = _policy.GradStats(
        finite=finite,
        step=state.num_steps,
        grad_norm=_numerics.global_norm(unscaled),
        amax=_numerics.global_amax(grads) if "amax" in policy.stats else None)
    new_scale, policy_state = policy.update(scale, state.policy_state, stats)
    new_state = LossScaleState(
        loss_scale=jnp.asarray(new_scale, jnp.float32),
        num_steps=optax.safe_increment(state.num_steps),
        num_skipped=jnp.where(finite, state.num_skipped, optax.safe_increment(state.num_skipped)),
        consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
        last_step_finite=finite,
        grad_norm=stats.grad_norm,
        policy_state=policy_state,
        inner_state=inner_state)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    warmup_steps: int = 0,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling around any optax transformation.

  Micikevicius et al. (2018), *Mixed Precision Training*: the loss is
  multiplied by S before differentiation (see :func:`scale_loss`); this
  transformation unscales the gradients, skips the step (zero updates, inner
  state untouched) when any is non-finite and backs S off, and grows S after
  ``growth_interval`` consecutive finite steps. See :func:`dynamic_policy`
  for the rule and every hyperparameter's default and valid range, and
  :func:`loss_scaled` for the contract of one update.

  Args:
    inner: the optax transformation to wrap, e.g. ``optax.adamw(3e-4)``.
    init_scale, growth_factor, backoff_factor, growth_interval, min_scale,
      max_scale, hysteresis, consecutive_hysteresis, warmup_steps: as in
      :func:`dynamic_policy`.
    axis_name: as in :func:`loss_scaled`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: a hyperparameter outside its range (the message names it).
    TypeError: a wrong type, or a traced value where a static number is needed.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)
    >>> params = {'w': jnp.ones(3)}
    >>> state = tx.init(params)
    >>> loss_fn = lambda p: optax_dls.scale_loss(jnp.sum(p['w'] ** 2), state)
    >>> grads = jax.grad(loss_fn)(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> updates['w']
    Array([-0.2, -0.2, -0.2], dtype=float32)
  """
  policy = _policy.dynamic_policy(
      init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
      growth_interval=growth_interval, min_scale=min_scale, max_scale=max_scale,
      hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
      warmup_steps=warmup_steps)
  return loss_scaled(inner, policy, axis_name=axis_name)


def static_loss_scale(
    inner: optax.GradientTransformation,
    scale: float,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """A fixed loss scale around ``inner``; non-finite steps are still skipped.

  Args:
    inner: the optax transformation to wrap.
    scale: float in [2**-126, 2**126], the constant loss scale.
    axis_name: as in :func:`loss_scaled`.

  Raises:
    ValueError: ``scale`` out of range. TypeError: a wrong or traced value.
  """
  return loss_scaled(inner, _policy.static_policy(scale), axis_name=axis_name)


def no_loss_scale(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """No loss scaling (bf16 or fp32 training), with the same state layout.

  Gradients go to ``inner`` unchanged, nothing is checked or skipped, and the
  result is bit-for-bit that of ``inner`` alone; :func:`loss_scale` reads 1
  and :func:`metrics` still work, so one training loop serves fp16, bf16 and
  fp32.

  Raises:
    TypeError: ``inner`` is not an optax transformation.
  """
  return loss_scaled(inner, _policy.noop_policy())
