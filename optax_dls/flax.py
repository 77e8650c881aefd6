"""Flax integration: loss-scaled ``value_and_grad`` for linen ``TrainState`` and ``nnx.Optimizer``.

Importing this module imports flax (the ``flax`` extra); ``import optax_dls``
alone never does. The optimizer itself needs nothing flax-specific: build it
with :func:`optax_dls.dynamic_loss_scale` and hand it to
``TrainState.create(tx=...)`` or ``nnx.Optimizer(model, tx, wrt=nnx.Param)``;
``TrainState.apply_gradients(grads=grads)`` and
``nnx.Optimizer.update(model, grads)`` then unscale, check, skip and adapt
with no extra arguments. ``value_and_grad(..., max_tries=k)`` recomputes an
overflowing step at a backed-off scale inside the jitted step instead of
skipping it (:func:`optax_dls.value_and_grad`).

Step counts: ``TrainState.step`` and ``nnx.Optimizer.step`` advance on every
call, skipped steps included (flax knows nothing of skips). The number of
updates actually applied is ``metrics(...)['num_steps'] -
metrics(...)['skip_count']`` (:func:`optax_dls.metrics`).

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_dls import _versions

_versions.check_flax()  # before flax is used: a clear ImportError when it is too old

from flax import nnx

from optax_dls import _access, _validation
from optax_dls._access import find_state, scale_loss
from optax_dls._recompute import value_and_grad as _recompute_value_and_grad
from optax_dls._transform import apply_step

__all__ = ["apply_gradients", "value_and_grad"]

_OVERWRITE_WITH_GRADIENT = (
  "_overwrite_with_gradient"  # flax's key for gradient-overwritten (fp8) params
)


def _differentiates_module(args: tuple[Any, ...], argnums: int | tuple[int, ...]) -> bool:
  nums = (argnums,) if isinstance(argnums, int) else argnums
  return any(isinstance(args[i], nnx.Module) for i in nums if i < len(args))


def value_and_grad(
  fun: Callable[..., Any],
  opt: Any,
  *,
  argnums: int | tuple[int, ...] = 0,
  has_aux: bool = False,
  max_tries: int | None = None,
  fp32_fun: Callable[..., Any] | None = None,
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

  **Recomputing an overflowing step** (``max_tries`` given): when the
  gradients overflow, the step backs S off and computes them again for the
  same arguments, inside the same compiled step, as
  :func:`optax_dls.value_and_grad` does (up to ``max_tries`` more float16
  passes, then one with ``fp32_fun`` if given), so that no batch is lost.
  The gradients come back scaled by the new S, which the optimizer state
  must then carry; so the call also hands back the optimizer state:

  * linen: the returned function returns ``((loss, grads), state)``
    (``(((loss, aux), grads), state)`` with ``has_aux``), ``state`` being
    ``opt`` with its ``opt_state`` replaced, the state to call
    ``apply_gradients`` on. This differs from the call without ``max_tries``::

        grad_fn = optax_dls.flax.value_and_grad(loss_fn, state, max_tries=3)
        (loss, grads), state = grad_fn(state.params, batch)
        state = state.apply_gradients(grads=grads)

  * nnx: the return is unchanged, ``(loss, grads)``; ``opt.opt_state`` is
    updated in place (nnx objects are mutable, inside ``nnx.jit`` too), and
    the state updates ``fun`` makes to the ``nnx.Module`` arguments
    (``BatchNorm`` statistics, RNG counts) are those of the try whose
    gradients are returned; a failed try's are dropped::

        grad_fn = optax_dls.flax.value_and_grad(loss_fn, optimizer, max_tries=3)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)

  Every try starts from the arguments as they were at the call (the same
  RNG state: the same dropout masks). The module arguments are split with
  ``nnx.split`` and merged back inside the loop, so ``fun`` must not add new
  variables to them (``sow``).

  Args:
    fun: the loss function; its arguments are those of the returned function.
    opt: where to read S: a linen ``TrainState``, an ``nnx.Optimizer``, or
      (without ``max_tries``) any optimizer state holding exactly one
      :class:`optax_dls.LossScaleState`. With ``max_tries``, a ``TrainState``
      or an ``nnx.Optimizer`` whose ``tx`` is the loss-scaled transformation
      itself (what :func:`optax_dls.dynamic_loss_scale` returns, not a chain
      around it).
    argnums: int or tuple of ints, the positional arguments to differentiate.
      Default 0.
    has_aux: whether ``fun`` returns ``(loss, aux)``. Default False.
    max_tries: None (default: no recomputation) or an int in [0, 64], the
      float16 recomputations after the first pass.
    fp32_fun: optional, ``fun`` computed in float32, the last resort when
      every float16 try overflowed (same signature and outputs); needs
      ``max_tries``. Default None.

  Returns:
    A function with ``fun``'s signature returning ``(loss, grads)``, or
    ``((loss, aux), grads)`` with ``has_aux``; ``grads`` are multiplied by S.
    With ``max_tries`` and a ``TrainState``, ``(that, state)``.

  Raises:
    TypeError: ``fun`` or ``fp32_fun`` is not callable, ``has_aux`` is not a
      bool, ``argnums`` is not an int or tuple of ints, ``max_tries`` is not
      an int, or, with ``max_tries``, ``opt`` is not a ``TrainState`` or an
      ``nnx.Optimizer`` with a loss-scaled ``tx``; (when called) the loss is
      not floating point, or ``fun`` does not return a ``(loss, aux)`` pair
      with ``has_aux=True``.
    ValueError: ``opt`` holds no loss-scale state, or more than one (checked
      here, before any tracing); ``max_tries`` out of range, or ``fp32_fun``
      without ``max_tries``.
  """
  _validation.function("fun", fun)
  has_aux = _validation.boolean("has_aux", has_aux)
  argnums = _validation.argnums(argnums)
  if fp32_fun is not None:
    _validation.function("fp32_fun", fp32_fun)
    if max_tries is None:
      raise ValueError(
        "fp32_fun is the last resort of a recomputed step: pass max_tries too "
        "(e.g. max_tries=3), or drop fp32_fun."
      )
  is_opt = isinstance(opt, nnx.Optimizer)
  if max_tries is not None:
    max_tries = _validation.count("max_tries", max_tries, low=0, high=64)
    _check_recomputable(opt, is_opt)
  source = opt.opt_state if is_opt else opt
  find_state(source)
  wrt = getattr(opt, "wrt", nnx.Param) if is_opt else nnx.Param
  if max_tries is not None:
    return _recomputing(fun, fp32_fun, opt, is_opt, wrt, argnums, has_aux, max_tries)

  def grad_fn(*args, **kwargs):
    state = find_state(source)  # plain arrays, read outside any nnx transform

    def scaled(*a, **k):
      loss, aux = _loss_and_aux(fun, has_aux, a, k)
      return scale_loss(loss, state), (loss, aux)

    if _differentiates_module(args, argnums):
      nums = (argnums,) if isinstance(argnums, int) else argnums
      diff = tuple(nnx.DiffState(i, wrt) for i in nums)
      vg = nnx.value_and_grad(
        scaled, argnums=diff[0] if isinstance(argnums, int) else diff, has_aux=True
      )
    else:
      vg = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)
    (_, (loss, aux)), grads = vg(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return grad_fn


def _loss_and_aux(
  f: Callable[..., Any], has_aux: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any]:
  out = f(*args, **kwargs)
  if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(
      f"with has_aux=True, fun ({getattr(f, '__qualname__', f)!r}) must return a "
      "(loss, aux) pair, got "
      f"{f'an array of shape {out.shape}' if hasattr(out, 'shape') else f'a {type(out).__name__}'}."
    )
  return out if has_aux else (out, None)


def _check_recomputable(opt: Any, is_opt: bool) -> None:
  """TypeError unless ``opt`` carries the loss-scaled ``tx`` that backs the scale off between tries."""
  if not is_opt and not all(hasattr(opt, f) for f in ("tx", "opt_state", "replace")):
    raise TypeError(
      "with max_tries, opt must be a flax TrainState or an nnx.Optimizer (its tx "
      f"backs the scale off between tries), got {type(opt).__name__}: {repr(opt)[:200]}."
    )
  if not callable(getattr(opt.tx, "back_off", None)):
    raise TypeError(
      "with max_tries, opt.tx must be the loss-scaled transformation itself "
      "(optax_dls.dynamic_loss_scale, loss_scaled, ...), not a wrapper around it, "
      f"got {opt.tx!r}."
    )


def _recomputing(
  fun: Callable[..., Any],
  fp32_fun: Callable[..., Any] | None,
  opt: Any,
  is_opt: bool,
  wrt: Any,
  argnums: int | tuple[int, ...],
  has_aux: bool,
  max_tries: int,
) -> Callable[..., Any]:
  """``value_and_grad`` with ``max_tries``: :func:`optax_dls.value_and_grad` on pure
  functions, the ``nnx.Module`` arguments split outside the loop and merged inside."""
  nums = (argnums,) if isinstance(argnums, int) else argnums
  in_wrt = nnx.filterlib.to_predicate(wrt)

  def grad_fn(*args, **kwargs):
    if max(nums) >= len(args):
      raise TypeError(
        f"argnums={argnums!r} asks for positional argument {max(nums)}, but the "
        f"function was called with {len(args)} positional arguments."
      )
    where = tuple(i for i, a in enumerate(args) if isinstance(a, nnx.Module))
    diff = frozenset(k for k, i in enumerate(where) if i in nums)  # among the modules
    is_diff = lambda path, x: path[0] in diff and in_wrt(path[1:], x)
    modules = tuple(args[i] for i in where)
    graphdef, diff_state, rest = nnx.split(modules, is_diff, ...)
    pure_args = list(args)
    for k, i in enumerate(where):
      pure_args[i] = (diff_state[k] if k in diff_state else nnx.State({})) if k in diff else None

    def pure(f):
      def run(*a, **k):
        parts = [nnx.State({j: a[i].raw_mapping}) for j, i in enumerate(where) if j in diff]
        merged = _merge(graphdef, rest, *parts) if where else ()
        full = list(a)
        for j, i in enumerate(where):
          full[i] = merged[j]
        loss, aux = _loss_and_aux(f, has_aux, tuple(full), k)
        return loss, (aux, nnx.split(merged, is_diff, ...)[2] if where else None)

      return run

    tx_state = find_state(opt.opt_state)
    vg = _recompute_value_and_grad(
      pure(fun),
      opt.tx,
      fp32_fun=None if fp32_fun is None else pure(fp32_fun),
      max_tries=max_tries,
      argnums=argnums,
      has_aux=True,
    )
    ((loss, (aux, new_rest)), grads), new = vg(tx_state, *pure_args, **kwargs)
    if where:
      nnx.update(modules, new_rest)
    value = (loss, aux) if has_aux else loss
    if is_opt:
      _write_in_place(opt.opt_state, new)
      return value, grads
    return (value, grads), opt.replace(opt_state=_access.replace_state(opt.opt_state, new))

  return grad_fn


def _merge(graphdef: Any, *states: Any) -> Any:
  """``nnx.merge`` into new Variables (flax >= 0.12 would otherwise reuse those in ``states``)."""
  return nnx.merge(graphdef, *states, **_MERGE_COPY)


_MERGE_COPY = {"copy": True} if "copy" in inspect.signature(nnx.merge).parameters else {}


def _write_in_place(opt_state: Any, new: Any) -> None:
  """Writes the leaves of ``new`` into the ``nnx.Variable`` leaves of ``opt_state``'s
  :class:`LossScaleState`, each in its own dtype."""
  (node,) = _access._find_all(opt_state)
  for var, value in zip(
    jax.tree.leaves(node, is_leaf=_access._is_variable), jax.tree.leaves(new), strict=True
  ):
    if hasattr(var, "set_value"):  # flax >= 0.12
      var.set_value(jnp.asarray(value, var.get_value().dtype))
    else:
      var.value = jnp.asarray(value, var.value.dtype)


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
    raise TypeError(
      f"state must be a flax TrainState, got {type(state).__name__}: {repr(state)[:200]}."
    )
  overwrite = isinstance(grads, dict) and _OVERWRITE_WITH_GRADIENT in grads
  params = state.params["params"] if overwrite else state.params
  params, opt_state = apply_step(
    state.tx, grads["params"] if overwrite else grads, state.opt_state, params
  )
  if overwrite:
    params = {"params": params, _OVERWRITE_WITH_GRADIENT: grads[_OVERWRITE_WITH_GRADIENT]}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, **kwargs)
