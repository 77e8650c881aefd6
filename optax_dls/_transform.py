"""The optax wrapper: unscale -> check -> inner.update -> skip -> policy.update."""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_dls import _fallback, _monitoring, _numerics, _policy, _validation
from optax_dls._state import LossScaleState, init_state

# update function of each loss-scaled transformation -> its step (see apply_step)
_STEPS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def loss_scaled(
    inner: optax.GradientTransformation,
    policy: _policy.LossScalePolicy,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    alerts: bool = False,
    alert_after: int = 3,
    min_scale: float | None = None,
    underflow_stats: Any = None,
    fallback_after: int | None = None,
    fallback_steps: int = 100,
    fallback_scale: float | None = None,
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
      ``update`` are forwarded to it. An ``optax.MultiSteps`` (gradient
      accumulation) is accepted as is: a non-finite micro-batch is then
      dropped before it reaches the accumulator.
    policy: a :class:`LossScalePolicy`, e.g. :func:`dynamic_policy`.
    axis_name: ``None`` (default), a mapped axis name or a tuple of names.
      Needed under ``pmap`` / ``shard_map``: the finite flag is reduced over
      every named axis so that all devices skip together, and the stored
      ``grad_norm`` (and ``amax``) become the same on every device (see
      ``docs/multi_device.md`` for what the norm means there).
      Name every axis the gradients are sharded or computed over (e.g.
      ``("data", "model")``). Not needed under ``jit`` with
      ``NamedSharding``. Under ``vmap`` with an axis name it makes every
      member share one decision; without one each member keeps its own scale.
    alerts: bool, default False. Log one warning (logger ``optax_dls``, from
      process 0, device 0 of the named axes) when ``consecutive_skips``
      reaches ``alert_after`` (once per run of skips), and one on the first
      skip taken at ``min_scale``; each gives the step (0-based index of the
      update), the new loss scale and the skip count. Done by an ordered
      ``io_callback`` inside a
      ``lax.cond`` that runs only then. With False (the default) no callback
      is compiled: a program holding a host callback loses JAX's fast
      dispatch path (measured: a 470k-parameter fp16 train step ~15-20%
      slower on CPU) and cannot be serialised by ``jax.export``.
      Alerts are off under ``vmap``.
    alert_after: int in [1, 2**31 - 1], default 3.
    min_scale: float or None (default). The policy's floor, which the
      policy must never go below. Used to detect a scale stuck at the
      minimum (``skips_at_min_scale`` and its alert), and, when it is at
      least 1, to know that unscaling cannot overflow a finite gradient, so
      the finite check needs a single read of the gradients (otherwise an
      extra exact check runs whenever the scale is below 1).
      :func:`dynamic_loss_scale` and :func:`static_loss_scale` pass their own.
    underflow_stats: None (default, off: nothing computed), True, a pytree
      of string labels matching the gradients, or a callable
      ``grads -> labels`` as in ``optax.multi_transform``. When on, every
      update stores the fractions of zero and of fp16-subnormal
      (0 < |x| < 2**-14) entries of the unscaled gradients, overall and per
      label, read by :func:`metrics` as ``'underflow/zero_frac'``,
      ``'underflow/<label>/subnormal_frac'``, ...
    fallback_after: int >= 1 or None (default, off). After this many
      consecutive skipped steps the state's ``fp32_fallback`` flag turns on
      for ``fallback_steps`` updates; :func:`select_precision` then runs the
      float32 loss. When it turns off the loss scale is reset to
      ``fallback_scale`` (default: the policy's initial scale) and the
      policy state to its initial value. 10 is a common choice.
    fallback_steps: int >= 1, updates the fallback lasts. Default 100.
      Checked even when ``fallback_after`` is None.
    fallback_scale: float in [2**-126, 2**126] or None (default). Checked
      even when ``fallback_after`` is None.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: ``inner`` is not an optax transformation, ``policy`` is not a
      usable :class:`LossScalePolicy` (``stats`` a tuple of strings,
      ``passthrough`` a bool, ``init()`` a ``(loss_scale, policy_state)`` pair
      whose state is a pytree of arrays; at trace time, ``update`` returning a
      floating ``()`` scale and a state of ``init``'s structure and dtypes), ``axis_name``
      is not a string or tuple of strings, or ``alerts`` is not a bool.
    ValueError: a hyperparameter out of range, or ``policy.init()`` returns a
      loss scale that is not a finite float32 ``()`` value > 0 (or not 1 with
      ``passthrough=True``).
    ValueError: at trace time, from ``update`` under ``shard_map`` (with
      ``check_vma=True``, the default) when the gradients vary over a mesh
      axis that ``axis_name`` leaves out while the loss-scale state is
      replicated over it (not detectable under ``pmap``), or when
      ``axis_name`` names an axis that is not mapped where ``update`` runs
      (e.g. under plain ``jit``).
  """
  if isinstance(inner, optax.MultiSteps):
    inner = inner.gradient_transformation()
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {inner!r} of type {type(inner).__name__}.")
  policy = _policy.check_policy(policy)
  axis_name = _numerics.check_axis_name(axis_name)
  alerts = _validation.boolean("alerts", alerts)
  alert_after = _monitoring.check_alert_after(alert_after)
  if min_scale is not None:
    min_scale = _policy._scale_value("min_scale", min_scale)
  uopt = _monitoring.check_underflow_option(underflow_stats)
  fallback = _fallback.FallbackConfig(fallback_after, fallback_steps, fallback_scale)
  fallback = None if fallback.after is None else fallback
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    scale, policy_state = policy.init()
    return init_state(scale, policy_state, inner.init(params),
                      underflow=_monitoring.underflow_init(uopt, params))

  def observe(new, old, scale, finite, unscaled_fn):
    """Underflow statistics, stuck-at-minimum count, fallback and alerts (each only when on)."""
    changes = {}
    if uopt is not None:
      changes["underflow"] = _monitoring.underflow_fractions(uopt, unscaled_fn(), axis_name)
    if min_scale is not None:
      changes["skips_at_min_scale"] = jnp.where(
          ~finite & (scale <= min_scale), optax.safe_increment(old.skips_at_min_scale), 0).astype(jnp.int32)
    if fallback is not None:
      active, left, ended = _fallback.advance(
          fallback, finite=finite, consecutive=new.consecutive_skips,
          active=old.fp32_fallback, steps_left=old.fallback_steps_left)
      init_scale, init_policy_state = policy.init()
      reset_to = init_scale if fallback.scale is None else fallback.scale
      changes.update(
          fp32_fallback=active, fallback_steps_left=left,
          loss_scale=jnp.where(ended, reset_to, new.loss_scale).astype(jnp.float32),
          policy_state=jax.tree.map(lambda a, b: jnp.where(ended, a, b).astype(jnp.result_type(b)),
                                    init_policy_state, new.policy_state))
    new = new._replace(**changes)
    if alerts:
      _monitoring.emit_alerts(
          step=old.num_steps, scale=new.loss_scale, consecutive=new.consecutive_skips,
          at_min=changes.get("skips_at_min_scale"), alert_after=alert_after, axis_name=axis_name)
    return new

  def step(grads, state, params, extra_args, into_params):
    """One update; with ``into_params`` it returns new params instead of updates,
    applied inside the skip branch so that XLA fuses them with the optimizer."""
    if not isinstance(state, LossScaleState):
      raise TypeError(
          f"opt_state must be the state this loss-scaled transformation's init returned (a "
          f"LossScaleState), got a {type(state).__name__}: {repr(state)[:200]}.")
    if into_params and params is None:
      raise TypeError("apply_step needs params (the parameters to update), got params=None.")
    _numerics.check_axis_coverage(grads, state.loss_scale, axis_name)
    post = (lambda u: optax.apply_updates(params, u)) if into_params else (lambda u: u)
    if policy.passthrough:
      updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
      return post(updates), state._replace(
          underflow=state.underflow if uopt is None else _monitoring.underflow_fractions(uopt, grads, axis_name),
          num_steps=optax.safe_increment(state.num_steps),
          grad_norm=jnp.sqrt(_numerics.sum_squares(grads, axis_name)),
          inner_state=inner_state)

    scale = state.loss_scale
    inv_scale = (1.0 / scale).astype(jnp.float32)
    # The unscaled gradients are never materialised: the check reduces them in
    # one fused read, and the inner update unscales again inside the cond, fused
    # into its own elementwise work. Gradients: one read to check, one to step.
    finite, grad_norm = _numerics.finite_and_norm(grads, inv_scale, axis_name)

    def apply(operands):
      g, inner_state, kept = operands
      p = kept if into_params else params  # one operand for params, so XLA can update them in place
      updates, inner_state = inner.update(_numerics.unscale(g, inv_scale), inner_state, p, **extra_args)
      return (optax.apply_updates(p, updates) if into_params else updates), inner_state

    def skip(operands):
      _, inner_state, kept = operands
      if into_params:  # bit-for-bit the old params (adding zeros would turn -0.0 into 0.0)
        return kept, inner_state
      shapes = jax.eval_shape(apply, operands)[0]
      return jax.tree.map(_numerics.zeros_of, shapes), inner_state

    updates, inner_state = lax.cond(
        finite, apply, skip, (grads, state.inner_state, params if into_params else None))

    stats = _policy.GradStats(
        finite=finite,
        step=state.num_steps,
        grad_norm=grad_norm,
        amax=_numerics.reduced_amax(grads, axis_name) if "amax" in policy.stats else None)
    new_scale, policy_state = policy.update(scale, state.policy_state, stats)
    new_state = state._replace(
        loss_scale=jnp.asarray(new_scale, jnp.float32),
        num_steps=optax.safe_increment(state.num_steps),
        num_skipped=jnp.where(finite, state.num_skipped, optax.safe_increment(state.num_skipped)),
        consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
        last_step_finite=finite,
        grad_norm=stats.grad_norm,
        policy_state=policy_state,
        inner_state=inner_state)
    return updates, observe(new_state, state, scale, finite, lambda: _numerics.unscale(grads, inv_scale))

  def update_fn(grads, state, params=None, **extra_args):
    return step(grads, state, params, extra_args, into_params=False)

  _STEPS[update_fn] = step
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
    alerts: bool = False,
    alert_after: int = 3,
    underflow_stats: Any = None,
    fallback_after: int | None = None,
    fallback_steps: int = 100,
    fallback_scale: float | None = None,
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
    init_scale: initial loss scale. Default ``2**15``.
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: consecutive finite steps before a growth. Default 2000.
    min_scale: floor of the scale. Default 1.
    max_scale: ceiling of the scale (never inf). Default ``2**24``.
    hysteresis: overflows tolerated before a backoff. Default 1.
    consecutive_hysteresis: refill the hysteresis on every finite step.
      Default False.
    warmup_steps: no growth before this many updates. Default 0.
    axis_name: as in :func:`loss_scaled`. Default None.
    alerts: as in :func:`loss_scaled`. Default False.
    alert_after: as in :func:`loss_scaled`. Default 3.
    underflow_stats: as in :func:`loss_scaled`. Default None (off).
    fallback_after: as in :func:`loss_scaled`. Default None (off).
    fallback_steps: as in :func:`loss_scaled`. Default 100.
    fallback_scale: as in :func:`loss_scaled`. Default None.

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
  return loss_scaled(
      inner, policy, axis_name=axis_name, alerts=alerts, alert_after=alert_after,
      min_scale=min_scale, underflow_stats=underflow_stats, fallback_after=fallback_after,
      fallback_steps=fallback_steps, fallback_scale=fallback_scale)


def static_loss_scale(
    inner: optax.GradientTransformation,
    scale: float,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    alerts: bool = False,
    alert_after: int = 3,
    underflow_stats: Any = None,
    fallback_after: int | None = None,
    fallback_steps: int = 100,
) -> optax.GradientTransformationExtraArgs:
  """A fixed loss scale around ``inner``; non-finite steps are still skipped.

  Args:
    inner: the optax transformation to wrap.
    scale: float in [2**-126, 2**126], the constant loss scale.
    axis_name: as in :func:`loss_scaled`.
    alerts: as in :func:`loss_scaled`.
    alert_after: as in :func:`loss_scaled`.
    underflow_stats: as in :func:`loss_scaled`.
    fallback_after: as in :func:`loss_scaled`.
    fallback_steps: as in :func:`loss_scaled`.

  Raises:
    ValueError: ``scale`` out of range.
    TypeError: a wrong or traced value.
  """
  return loss_scaled(
      inner, _policy.static_policy(scale), axis_name=axis_name, alerts=alerts,
      alert_after=alert_after, min_scale=scale, underflow_stats=underflow_stats,
      fallback_after=fallback_after, fallback_steps=fallback_steps)


def no_loss_scale(
    inner: optax.GradientTransformation,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """No loss scaling (bf16 or fp32 training), with the same state layout.

  Gradients go to ``inner`` unchanged, nothing is checked or skipped, and the
  result is bit-for-bit that of ``inner`` alone; :func:`loss_scale` reads 1
  and :func:`metrics` still work, so one training loop serves fp16, bf16 and
  fp32.

  Args:
    inner: the optax transformation to wrap.
    axis_name: as in :func:`loss_scaled`; here it only makes the stored
      ``grad_norm`` metric the norm over every device (needed under
      ``shard_map`` with sharded gradients, where it would otherwise differ
      between devices).

  Raises:
    TypeError: ``inner`` is not an optax transformation.
  """
  return loss_scaled(inner, _policy.noop_policy(), axis_name=axis_name)


def apply_step(
    tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, **extra_args: Any,
) -> tuple[Any, Any]:
  """One optimizer step returning new parameters: ``update`` and ``apply_updates`` fused.

  Equivalent to::

      updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
      params = optax.apply_updates(params, updates)

  but for a transformation built by :func:`loss_scaled` (or
  :func:`dynamic_loss_scale`, ...) the updates are applied *inside* the skip
  branch: XLA then fuses them with the inner optimizer's own arithmetic, as
  it does for a bare optimizer, instead of writing the updates out and
  reading them back. The result equals the two calls up to the rounding of
  the fused arithmetic (XLA may contract or reorder it, within an ulp or
  so). On a skipped step the parameters come back bit for bit. For any
  other transformation it falls back to the two calls above.

  Args:
    tx: the optax transformation, usually loss-scaled.
    grads: the (scaled) gradients, a pytree matching ``params``.
    opt_state: ``tx``'s state.
    params: the parameters; required.
    **extra_args: forwarded to ``tx.update``.

  Returns:
    ``(new_params, new_opt_state)``.

  Raises:
    TypeError: ``tx`` is not an optax transformation.

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
    raise TypeError(f"tx must be an optax.GradientTransformation, got {tx!r} of type {type(tx).__name__}.")
  step = _STEPS.get(tx.update)
  if step is None:
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state
  return step(grads, opt_state, params, extra_args, into_params=True)
