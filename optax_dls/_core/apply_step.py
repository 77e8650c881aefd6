"""``apply_step``: ``update`` and ``optax.apply_updates`` fused, by the transformation's own
``fused_step``."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax

from optax_dls._core import accumulation as _accumulation
from optax_dls._core.state import LossScaleState


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
    ValueError: ``tx`` is ``optax.MultiSteps`` around a loss-scaled transformation
      (put the loss scaling outside: ``dynamic_loss_scale(optax.MultiSteps(...))``).

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> params, state = optax_dls.apply_step(tx, {'w': jnp.full(2, 4.0)}, state, params)
    >>> params['w']
    Array([0.5, 0.5], dtype=float32)
  """
  _accumulation.refuse_multisteps_outside(tx)
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
