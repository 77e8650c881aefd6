"""Flax integration: loss-scaled ``value_and_grad`` for linen ``TrainState`` and ``nnx.Optimizer``.

Importing this module imports flax (the ``flax`` extra); ``import optax_dls``
alone never does. The optimizer itself needs nothing flax-specific: build it
with :func:`optax_dls.dynamic_loss_scale` and hand it to
``TrainState.create(tx=...)`` or ``nnx.Optimizer(model, tx, wrt=nnx.Param)``;
``TrainState.apply_gradients(grads=grads)`` and
``nnx.Optimizer.update(model, grads)`` then unscale, check, skip and adapt
with no extra arguments.

Step counts: ``TrainState.step`` and ``nnx.Optimizer.step`` advance on every
call, skipped steps included (flax knows nothing of skips). The number of
updates actually applied is ``metrics(...)['num_steps'] -
metrics(...)['skip_count']`` (:func:`optax_dls.metrics`).

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from optax_dls import _access
from optax_dls import _validation as v
from optax_dls._access import find_state, scale_loss
from optax_dls._recompute import value_and_grad as _recompute_value_and_grad
from optax_dls._transform import apply_step

__all__ = ["apply_gradients", "value_and_grad"]

_OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # flax's key for gradient-overwritten (fp8) params


def _differentiates_module(args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> bool:
  nums = (argnums,) if isinstance(argnums, int) else argnums
  return any(isinstance(args[i], nnx.Module) for i in nums if i < len(args))


def value_and_grad(
    fun: Callable[..., Any],
    opt: Any,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad`` / ``nnx.value_and_grad``, with the loss scaled by S.

  ``fun`` returns the plain (unscaled) loss, a floating scalar (any float
  dtype; fp16 is promoted to float32 before scaling so the scaled loss cannot
  overflow), or ``(loss, aux)`` with ``has_aux=True``. The returned function
  differentiates ``S * loss`` with S the current loss scale of ``opt``, and
  returns the *unscaled* loss (exactly what ``fun`` returned) together with
  the *scaled* gradients, which the loss-scaled optimizer unscales::

      grad_fn = optax_dls.flax.value_and_grad(loss_fn, state, has_aux=True)
      (loss, aux), grads = grad_fn(state.params, batch)       # linen
      state = state.apply_gradients(grads=grads)

      grad_fn = optax_dls.flax.value_and_grad(loss_fn, optimizer)
      loss, grads = grad_fn(model, batch)                      # nnx
      optimizer.update(model, grads)

  When a differentiated argument is an ``nnx.Module`` the gradient is taken
  with ``nnx.value_and_grad`` with respect to ``opt.wrt`` (the variables the
  ``nnx.Optimizer`` updates; ``nnx.Param`` when ``opt`` is not an
  ``nnx.Optimizer``); otherwise with ``jax.value_and_grad``. S is read when
  the returned function is called, so build it inside the jitted step (or
  call it there) with the current ``opt``.

  Args:
    fun: the loss function; its arguments are those of the returned function.
    opt: where to read S: a linen ``TrainState``, an ``nnx.Optimizer``, or any
      optimizer state holding exactly one :class:`optax_dls.LossScaleState`.
    argnums: int or tuple of ints, the positional arguments to differentiate.
      Default 0.
    has_aux: whether ``fun`` returns ``(loss, aux)``. Default False.

  Returns:
    A function with ``fun``'s signature returning ``(loss, grads)``, or
    ``((loss, aux), grads)`` with ``has_aux``; ``grads`` are multiplied by S.

  Raises:
    TypeError: ``fun`` is not callable, ``has_aux`` is not a bool, or
      ``argnums`` is not an int or tuple of ints; (when called) the loss is
      not floating point, or ``fun`` does not return a ``(loss, aux)`` pair
      with ``has_aux=True``.
    ValueError: ``opt`` holds no loss-scale state, or more than one (checked
      here, before any tracing).
  """
  v.function("fun", fun)
  has_aux = v.boolean("has_aux", has_aux)
  argnums = v.argnums(argnums)
  is_opt = isinstance(opt, nnx.Optimizer)
  source = opt.opt_state if is_opt else opt
  find_state(source)
  wrt = getattr(opt, "wrt", nnx.Param) if is_opt else nnx.Param

  def grad_fn(*args, **kwargs):
    state = find_state(source)  # plain arrays, read outside any nnx transform

    def scaled(*a, **k):
      out = fun(*a, **k)
      if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"with has_aux=True, fun ({getattr(fun, '__qualname__', fun)!r}) must return a "
            "(loss, aux) pair, got "
            f"{f'an array of shape {out.shape}' if hasattr(out, 'shape') else f'a {type(out).__name__}'}.")
      loss, aux = out if has_aux else (out, None)
      return scale_loss(loss, state), (loss, aux)

    if _differentiates_module(args, argnums):
      nums = (argnums,) if isinstance(argnums, int) else argnums
      diff = tuple(nnx.DiffState(i, wrt) for i in nums)
      vg = nnx.value_and_grad(scaled, argnums=diff[0] if isinstance(argnums, int) else diff,
                              has_aux=True)
    else:
      vg = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)
    (_, (loss, aux)), grads = vg(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return grad_fn


def apply_gradients(state: Any, *, grads: Any, **kwargs: Any) -> Any:
  """``state.apply_gradients(grads=grads, **kwargs)`` for a linen ``TrainState``,
  with the updates applied inside the skip branch (:func:`optax_dls.apply_step`).

  Same result as the method (up to the rounding of fused arithmetic, an ulp
  or so), including flax's ``_overwrite_with_gradient`` collection, but XLA
  fuses the parameter update with the optimizer instead of writing the
  updates out and reading them back: the fast path for a loss-scaled
  ``state.tx`` (see the performance guide). On a skipped step the
  parameters come back bit for bit. ``step`` advances by one either way, as
  with the method.

  Args:
    state: a ``flax.training.train_state.TrainState`` (or subclass) whose
      ``tx`` is loss-scaled, e.g. by :func:`optax_dls.dynamic_loss_scale`.
    grads: the *scaled* gradients (from :func:`value_and_grad`), with the
      structure of ``state.params``.
    **kwargs: other ``TrainState`` fields to replace, as with the method.

  Returns:
    The updated ``TrainState``.

  Raises:
    TypeError: ``state`` has no ``tx``, ``params`` or ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls, optax_dls.flax
    >>> from flax.training.train_state import TrainState
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.5), init_scale=4.0)
    >>> state = TrainState.create(apply_fn=None, params={'w': jnp.ones(2)}, tx=tx)
    >>> state = optax_dls.flax.apply_gradients(state, grads={'w': jnp.full(2, 4.0)})
    >>> state.params['w'], int(state.step)
    (Array([0.5, 0.5], dtype=float32), 1)
  """
  if not all(hasattr(state, f) for f in ("tx", "params", "opt_state", "step", "replace")):
    raise TypeError(f"state must be a flax TrainState, got {type(state).__name__}: {repr(state)[:200]}.")
  overwrite = isinstance(grads, dict) and _OVERWRITE_WITH_GRADIENT in grads
  params = state.params["params"] if overwrite else state.params
  params, opt_state = apply_step(state.tx, grads["params"] if overwrite else grads, state.opt_state, params)
  if overwrite:
    params = {"params": params, _OVERWRITE_WITH_GRADIENT: grads[_OVERWRITE_WITH_GRADIENT]}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, **kwargs)
