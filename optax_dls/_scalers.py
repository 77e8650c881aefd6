"""The loss scalers most users call: :func:`loss_scaled` with a built-in policy."""

from __future__ import annotations

import inspect
from typing import Any

import optax

from optax_dls import _policies
from optax_dls._transform import LossScaledTransformation, loss_scaled

_POLICY_ARGS = inspect.signature(_policies.dynamic_policy).parameters


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
  **policy_options: Any,
) -> LossScaledTransformation:
  """Dynamic loss scaling around any optax transformation.

  Micikevicius et al. (2018), *Mixed Precision Training*: the loss is
  multiplied by S before differentiation (see :func:`scale_loss`); this
  transformation unscales the gradients, skips the step (zero updates, inner
  state untouched) when any is non-finite and backs S off, and grows S after
  ``growth_interval`` consecutive finite steps. Shorthand for
  ``loss_scaled(inner, dynamic_policy(**policy_options), ...)``.

  Args:
    inner: the optax transformation to wrap, e.g. ``optax.adamw(3e-4)``.
    axis_name: as in :func:`loss_scaled`. Default None.
    skip_lowering: as in :func:`loss_scaled`. Default ``"auto"``.
    **policy_options: the arguments of :func:`dynamic_policy`, with its
      defaults and ranges: ``init_scale`` (``2**15``), ``growth_factor`` (2),
      ``backoff_factor`` (0.5), ``growth_interval`` (2000), ``min_scale``
      (1), ``max_scale`` (``2**24``), ``hysteresis`` (1),
      ``consecutive_hysteresis`` (False), ``warmup_steps`` (0).

  Returns:
    A :class:`LossScaledTransformation`.

  Raises:
    ValueError: a hyperparameter outside its range (the message names it).
    TypeError: an unknown keyword, a wrong type, or a traced value where a
      static number is needed.

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
  unknown = sorted(set(policy_options) - set(_POLICY_ARGS))
  if unknown:
    raise TypeError(
      f"dynamic_loss_scale got unknown keyword argument(s) {unknown}; it takes "
      f"axis_name, skip_lowering and the arguments of dynamic_policy: {list(_POLICY_ARGS)}."
    )
  return loss_scaled(
    inner,
    _policies.dynamic_policy(**policy_options),
    axis_name=axis_name,
    skip_lowering=skip_lowering,
  )


dynamic_loss_scale.__signature__ = inspect.signature(dynamic_loss_scale).replace(
  parameters=[
    p for p in inspect.signature(dynamic_loss_scale).parameters.values() if p.kind != p.VAR_KEYWORD
  ]
  + [p.replace(kind=p.KEYWORD_ONLY) for p in _POLICY_ARGS.values()]
)


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
) -> LossScaledTransformation:
  """A fixed loss scale around ``inner``; non-finite steps are still skipped.

  Shorthand for ``loss_scaled(inner, static_policy(scale), ...)``.

  Args:
    inner: the optax transformation to wrap.
    scale: float in [2**-126, 2**126], the constant loss scale.
    axis_name: as in :func:`loss_scaled`.
    skip_lowering: as in :func:`loss_scaled`.

  Raises:
    ValueError: ``scale`` out of range.
    TypeError: a wrong or traced value.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.static_loss_scale(optax.sgd(1.0), 8.0)
    >>> updates, _ = tx.update({'w': jnp.array([8.0])}, tx.init({'w': jnp.zeros(1)}))
    >>> updates['w']
    Array([-1.], dtype=float32)
  """
  return loss_scaled(
    inner, _policies.static_policy(scale), axis_name=axis_name, skip_lowering=skip_lowering
  )


def no_loss_scale(
  inner: optax.GradientTransformation,
  *,
  axis_name: str | tuple[str, ...] | None = None,
) -> LossScaledTransformation:
  """No loss scaling (bf16 or fp32 training), with the same state layout.

  Gradients go to ``inner`` unchanged, nothing is checked or skipped, and the
  result is bit-for-bit that of ``inner`` alone; :func:`loss_scale` reads 1
  and :func:`metrics` still work (``grad_norm`` is measured without
  overflow), so one training loop serves fp16, bf16 and fp32.

  Args:
    inner: the optax transformation to wrap.
    axis_name: as in :func:`loss_scaled`; here it only makes the stored
      ``grad_norm`` metric the norm over every device (needed under
      ``shard_map`` with sharded gradients, where it would otherwise differ
      between devices).

  Raises:
    TypeError: ``inner`` is not an optax transformation.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.no_loss_scale(optax.sgd(1.0))
    >>> updates, state = tx.update({'w': jnp.array([2.0])}, tx.init({'w': jnp.zeros(1)}))
    >>> updates['w'], float(optax_dls.loss_scale(state))
    (Array([-2.], dtype=float32), 1.0)
  """
  return loss_scaled(inner, _policies.noop_policy(), axis_name=axis_name)
