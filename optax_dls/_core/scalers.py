"""The loss scalers most users call: :func:`loss_scaled` with a built-in policy."""

from __future__ import annotations

import optax

from optax_dls import _policies
from optax_dls._core import labels as _labels
from optax_dls._core import transform as _transform
from optax_dls._core.transform import loss_scaled
from optax_dls._util import validation as _validation


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
  skip_lowering: str = "auto",
  labels: _labels.Labels = None,
) -> optax.GradientTransformationExtraArgs:
  """Dynamic loss scaling around any optax transformation.

  Micikevicius et al. (2018), *Mixed Precision Training*: the loss is multiplied by S
  before differentiation (:func:`scale_loss`); this transformation unscales the
  gradients, skips the step (zero updates, inner state untouched) when any is not finite
  and backs S off, and grows S after ``growth_interval`` consecutive finite steps.
  Shorthand for ``loss_scaled(inner, dynamic_policy(...), axis_name=..., ...)``.

  Args:
    inner: the optax transformation to wrap, e.g. ``optax.adamw(3e-4)``.
    init_scale: float, the first loss scale, in ``[min_scale, max_scale]``.
      Default ``2**15``.
    growth_factor: float > 1, finite. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [1, 2**31 - 1], consecutive finite steps before a
      growth. Default 2000.
    min_scale: float in [2**-126, 2**126], floor of the scale. Default 1.
    max_scale: float in [min_scale, 2**126], ceiling of the scale. Default ``2**24``.
    hysteresis: int in [1, 2**31 - 1], overflows tolerated before a backoff.
      Default 1 (every overflow backs off, as in PyTorch).
    consecutive_hysteresis: bool, refill the hysteresis on every finite step
      (DeepSpeed's option) instead of only on growth. Default False.
    warmup_steps: int in [0, 2**31 - 1], updates before the first growth.
      Default 0.
    axis_name: as in :func:`loss_scaled`. Default None.
    skip_lowering: as in :func:`loss_scaled`. Default ``"auto"``.
    labels: as in :func:`loss_scaled`. Default None.

  See :func:`dynamic_policy` for the rule these arguments set.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`LossScaleState`.

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
  policy = _policies.dynamic_policy(
    init_scale=init_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    min_scale=min_scale,
    max_scale=max_scale,
    hysteresis=hysteresis,
    consecutive_hysteresis=consecutive_hysteresis,
    warmup_steps=warmup_steps,
  )
  return loss_scaled(inner, policy, axis_name=axis_name, skip_lowering=skip_lowering, labels=labels)


def static_loss_scale(
  inner: optax.GradientTransformation,
  scale: float,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
  labels: _labels.Labels = None,
) -> optax.GradientTransformationExtraArgs:
  """A fixed loss scale around ``inner``; non-finite steps are still skipped.

  Shorthand for ``loss_scaled(inner, static_policy(scale), ...)``.

  Args:
    inner: the optax transformation to wrap.
    scale: float in [2**-126, 2**126], the constant loss scale.
    axis_name: as in :func:`loss_scaled`.
    skip_lowering: as in :func:`loss_scaled`.
    labels: as in :func:`loss_scaled`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose scale stays at ``scale``.

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
    inner,
    _policies.static_policy(scale),
    axis_name=axis_name,
    skip_lowering=skip_lowering,
    labels=labels,
  )


def no_loss_scale(
  inner: optax.GradientTransformation,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  track_grad_norm: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """No loss scaling (bf16 or fp32 training), with the same state layout.

  Gradients go to ``inner`` multiplied by 1/S (S = 1); nothing is checked or skipped, and
  the updates are ``inner``'s to rounding (XLA may contract the optimizer's multiply-adds
  otherwise than in the bare program), at its cost: the product fuses into the
  optimizer's read of the gradients. A state restored from a scaled run still holds that
  run's scale, which :func:`scale_loss` multiplies the first loss by: the first update
  divides the gradients by it and sets the scale to 1. :func:`metrics` works as under
  scaling, so one training loop serves fp16, bf16 and fp32; :func:`value_and_grad` and the
  Flax helpers do not multiply the loss.

  Args:
    inner: the optax transformation to wrap.
    axis_name: as in :func:`loss_scaled`; here it only makes the ``grad_norm``
      metric the norm over every device.
    track_grad_norm: bool, measure the global gradient norm for :func:`metrics` (one
      more read of the gradients per step, see the performance guide). Default False:
      ``grad_norm`` stays NaN.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose loss scale is 1.

  Raises:
    TypeError: ``inner`` is not an optax transformation, or ``track_grad_norm``
      is not a bool.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.no_loss_scale(optax.sgd(1.0))
    >>> updates, state = tx.update({'w': jnp.array([2.0])}, tx.init({'w': jnp.zeros(1)}))
    >>> updates['w'], float(state.loss_scale)
    (Array([-2.], dtype=float32), 1.0)
  """
  track = _validation.boolean("track_grad_norm", track_grad_norm)
  noop = _policies.static_policy(1.0)._replace(passthrough=True)
  return _transform.build(inner, noop, axis_name, "auto", None, track)
