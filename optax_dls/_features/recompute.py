"""Recomputing an overflowing step's gradients for the same batch inside the jitted step: backed
off up to a bounded number of tries, then in float32 if given; only then is the step skipped."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from optax_dls._access import find as _find
from optax_dls._access import loss as _loss
from optax_dls._core import accumulation as _accumulation
from optax_dls._core import multi_device as _multi_device
from optax_dls._core import numerics as _numerics
from optax_dls._core import transform as _transform
from optax_dls._core.state import LossScaleState
from optax_dls._features import recompute_stats as _recompute_stats
from optax_dls._util import calls as _calls
from optax_dls._util import model as _model
from optax_dls._util import validation as _validation

# A pass: the state to compute at -> ``(value, grads)``, cast to the types every pass returns.
Pass = Callable[[LossScaleState], tuple[Any, Any]]


class Try(NamedTuple):
  """One pass and what it decided: the retry loop's carry."""

  tries: jax.Array  # int32: the passes after the first one so far
  finite: jax.Array  # bool: this pass's loss and gradients are finite
  stuck: jax.Array  # bool: another float16 pass cannot help (a non-finite loss, an unmoved scale)
  at: LossScaleState  # the state this pass ran at: the scale of its gradients
  next: LossScaleState  # the state to compute at after this pass
  out: tuple[Any, Any]  # (value, grads)
  record: jax.Array  # for tx.update: this pass's check when its loss was not finite


class Outcome(NamedTuple):
  """What a recomputing call returns."""

  value: Any
  grads: Any
  finite: jax.Array
  opt_state: Any


class Plan(NamedTuple):
  """The static side of a recomputing ``grad_fn``."""

  fp16: Callable[..., Any]  # jax.grad of the scaled fun: (scale, /, *args, **kwargs)
  fp32: Callable[..., Any] | None
  update: Callable[..., Any]  # the loss-scaled transformation's
  max_tries: int
  argnums: int | tuple[int, ...]
  has_aux: bool
  axis_name: _multi_device.AxisName  # the gradients averaged over it in every pass
  pin: bool  # whether the gradients leave a retry branch (and are pinned to row-major)


def checked(
  fun: Any, fp32_fun: Any, max_tries: Any, argnums: Any, has_aux: Any
) -> tuple[int, int | tuple[int, ...], bool]:
  """:func:`value_and_grad`'s argument checks; ``(max_tries, argnums, has_aux)``."""
  _validation.function("fun", fun)
  if fp32_fun is not None:
    _validation.function("fp32_fun", fp32_fun)
  return (
    _validation.count("max_tries", max_tries, low=0, high=64),
    _validation.argnums(argnums),
    _validation.boolean("has_aux", has_aux),
  )


def make_plan(
  fun: Callable[..., Any],
  tx: Any,
  *,
  fp32_fun: Callable[..., Any] | None,
  max_tries: int,
  argnums: int | tuple[int, ...],
  has_aux: bool,
  axis_name: _multi_device.AxisName = None,
  tx_name: str = "tx",
) -> Plan:
  """The :class:`Plan` of a recomputing ``grad_fn``."""
  max_tries, argnums, has_aux = checked(fun, fp32_fun, max_tries, argnums, has_aux)
  _accumulation.refuse_multisteps_outside(tx, tx_name)
  if not _transform.is_loss_scaled(tx):
    raise TypeError(
      f"{tx_name} must be a loss-scaled transformation, got {tx!r}: wrap the optimizer with "
      f"optax_dls.dynamic_loss_scale (e.g. dynamic_loss_scale(optax.adam(1e-3)), or "
      "no_loss_scale for bfloat16); a chain around a loss-scaled transformation is not one "
      "either: put the chain inside it (dynamic_loss_scale(optax.chain(...)))."
    )
  fp32 = None if fp32_fun is None else _grads_of(fp32_fun, has_aux, argnums)
  return Plan(
    fp16=_grads_of(fun, has_aux, argnums),
    fp32=fp32,
    update=tx.update,
    max_tries=max_tries,
    argnums=argnums,
    has_aux=has_aux,
    axis_name=_multi_device.check_axis_name(axis_name),
    pin=bool(max_tries) or fp32 is not None,
  )


def value_and_grad(
  fun: Callable[..., Any],
  tx: Any,
  *,
  fp32_fun: Callable[..., Any] | None = None,
  max_tries: int = 3,
  argnums: int | tuple[int, ...] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of a loss-scaled loss that recomputes an overflowing step.

  ``grad_fn(opt_state, *args, **kwargs)`` differentiates ``S * fun(*args, **kwargs)``, S the loss
  scale in ``opt_state`` (Micikevicius et al. 2018, *Mixed Precision Training*). Non-finite
  gradients go to the policy as an overflow (S backs off, as on a skipped step) and are computed
  again at the new scale, for the same arguments, up to ``max_tries`` times, then once with
  ``fp32_fun`` if given; if every try overflowed, ``tx.update`` skips the step. Each failed try
  counts as a skipped step for growth and hysteresis; the result equals a step run at the final
  scale. Float16 retries stop after a back-off that left S unchanged, or at a non-finite loss (then
  ``tx.update`` skips and backs off once, :func:`metrics` reports ``nonfinite_loss``). Without an
  overflow it costs one pass and one read of the gradients; the retries run in a
  ``lax.while_loop`` behind a ``lax.cond``. On the CPU the gradients are then pinned to row-major
  (for ``jax.export``: ``DisabledSafetyCheck.custom_call("LayoutConstraint")``). Chain
  :func:`recompute_stats` inside ``tx`` to count retries. See ``docs/guide/recompute.md``.

  Args:
    fun: the loss function, returning the unscaled floating scalar loss (float16 is promoted to
      float32 before scaling), or ``(loss, aux)`` with ``has_aux=True``; any positional and keyword
      arguments.
    tx: the loss-scaled transformation itself (from :func:`loss_scaled` or
      :func:`dynamic_loss_scale`), not a chain around it.
    fp32_fun: optional, ``fun`` in float32, the last resort when every float16 try overflowed; same
      signature, output structure and shapes (both cast to their promoted dtypes). Default None.
    max_tries: int in [0, 64], float16 recomputations after the first pass. Default 3.
    argnums: int or tuple of ints, as in ``jax.value_and_grad``, counted in ``args`` (after
      ``opt_state``). Default 0.
    has_aux: bool, as in ``jax.value_and_grad``. Default False.

  Returns:
    ``grad_fn(opt_state, *args, **kwargs) -> ((value, grads), opt_state)``: ``value`` the loss
    (``(loss, aux)`` with ``has_aux``), ``grads`` the last try's, scaled by the loss scale of the
    ``opt_state`` returned.

  Raises:
    TypeError: ``fun`` / ``fp32_fun`` not callable, ``tx`` not loss-scaled, ``max_tries``,
      ``argnums`` or ``has_aux`` of the wrong type; when called, a non-floating loss, no
      ``(loss, aux)`` pair with ``has_aux``, fewer positional arguments than ``argnums``.
    ValueError: ``max_tries`` out of range, a negative or repeated ``argnums``, ``tx`` an
      ``optax.MultiSteps`` around a loss-scaled transformation; when called, a first argument
      holding no loss-scale state or several, ``fun`` and ``fp32_fun`` outputs differing in
      structure or shape, or more than one :func:`recompute_stats` in ``tx``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**16)
    >>> params = {'w': jnp.ones(1)}
    >>> half = lambda p: jnp.sum(p['w'].astype(jnp.float16) * 4.0)  # overflows at 2**16
    >>> loss = lambda p: half(p).astype(jnp.float32)  # the loss itself in float32
    >>> (value, grads), state = optax_dls.value_and_grad(loss, tx)(tx.init(params), params)
    >>> float(optax_dls.find_state(state).loss_scale), grads['w']  # at their scale
    (8192.0, Array([32768.], dtype=float32))
  """
  run = functools.partial(
    call,
    make_plan(fun, tx, fp32_fun=fp32_fun, max_tries=max_tries, argnums=argnums, has_aux=has_aux),
  )

  def grad_fn(opt_state: Any, /, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], Any]:
    outcome = run(opt_state, args, kwargs)
    return (outcome.value, outcome.grads), outcome.opt_state

  return grad_fn


def call(plan: Plan, opt_state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
  """One recomputing call of ``plan`` on ``fun(*args, **kwargs)``."""
  _calls.check_reach(plan.argnums, args, "opt_state")
  state = _loss_scale_state(opt_state, args)
  if _passthrough(plan, state):  # S = 1 by its rule: nothing overflows, nothing is retried
    plan = plan._replace(fp32=None, max_tries=0, pin=False)
  fp16, fp32, rebuild = _passes(plan, state, args, kwargs)
  light = state._replace(inner_state=())  # the tries carry the scale and the policy state only
  last = _try(plan, fp16, light, jnp.int32(0))  # the common case: one pass, outside the loop
  if plan.max_tries:  # the loop only after an overflow: on XLA's CPU a loop slows what is around it
    retry = lambda t: _try(plan, fp16, t.next, t.tries + 1)
    retries = lambda t: lax.while_loop(functools.partial(_again, plan), retry, t)
    last = lax.cond(_again(plan, last), retries, lambda t: t, last)
  if fp32 is not None:  # the last resort, at the state the last float16 pass left
    last = lax.cond(last.finite, lambda t: t, lambda t: _try(plan, fp32, t.next, t.tries + 1), last)
  at = last.at._replace(
    nonfinite=last.record, inner_state=_recompute_stats.record(state.inner_state, last.tries)
  )
  value, grads = last.out
  return Outcome(rebuild(value), grads, last.finite, _find.replace_state(opt_state, at))


def _passthrough(plan: Plan, state: LossScaleState) -> bool:
  """Whether the policy checks nothing (:func:`no_loss_scale`): its check is a constant."""
  said: list[bool] = []

  def probe(s: LossScaleState) -> tuple:
    with jax.ensure_compile_time_eval():  # a constant stays one inside the trace
      finite, _ = plan.update(None, s._replace(inner_state=_transform.BackOff()))
    said.append(not isinstance(finite, jax.core.Tracer) and bool(finite))
    return ()

  jax.eval_shape(probe, state._replace(inner_state=()))
  return said[0]


def _loss_scale_state(opt_state: Any, args: tuple[Any, ...]) -> LossScaleState:
  """:func:`find_state` of the first argument; else an error giving the calling order."""
  if _holds_state(opt_state):
    return _find.find_state(opt_state)
  words = ("opt_state", "the optimizer state", "holds no LossScaleState", "holds one")
  raise ValueError(_calls.order_error(*words, opt_state, _calls.first_index(args, _holds_state)))


def _holds_state(tree: Any) -> bool:
  try:
    return bool(_find.find_all(tree))
  except ValueError:  # a loss-scale state, misplaced: find_state says where
    return True


def _grads_of(
  f: Callable[..., Any], has_aux: bool, argnums: int | tuple[int, ...]
) -> Callable[..., Any]:
  """``jax.grad`` of ``S * loss``: ``(scale, /, *args, **kwargs) -> (grads, out)``."""
  nums = tuple(i + 1 for i in argnums) if isinstance(argnums, tuple) else argnums + 1
  which = argnums if isinstance(argnums, tuple) else (argnums,)

  def filtered(scale: jax.Array, /, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    # Only the floating arrays go to jax.grad, as eqx.filter_value_and_grad does.
    parts = {i: _model.partition(args[i]) for i in which}

    def whole(scale: jax.Array, /, *dyn: Any, **kw: Any) -> tuple[Any, Any]:
      full = [_model.combine(a, parts[i][1]) if i in parts else a for i, a in enumerate(dyn)]
      out = f(*full, **kw)
      loss, _ = _calls.loss_and_aux(f, has_aux, out)
      return _loss.times_scale(loss, scale), out  # checks the loss: a floating array

    dyn = [parts[i][0] if i in parts else a for i, a in enumerate(args)]
    return jax.grad(whole, argnums=nums, has_aux=True)(scale, *dyn, **kwargs)

  return filtered


def _passes(
  plan: Plan, state: LossScaleState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Pass, Pass | None, Callable[[Any], Any]]:
  """The float16 and float32 passes (``(value's array leaves, grads)`` in shared types) and the
  function that puts the value's other leaves back."""
  statics: list[Callable[[Any], Any]] = []  # from the first trace: the same in every pass
  trees: dict[str, Any] = {}  # the tree structure of each function's whole output

  def raw(grads_of: Callable[..., Any], name: str) -> Pass:
    def run(at: LossScaleState) -> tuple[Any, Any]:
      grads, full = grads_of(at.loss_scale, *args, **kwargs)
      out, rebuild = _calls.split_arrays(full)
      trees.setdefault(name, jax.tree.structure(full))
      if not statics:
        statics.append(rebuild)
      if plan.axis_name is not None:
        grads = lax.pmean(grads, plan.axis_name)
      return out, (_row_major(grads) if plan.pin else grads)

    return run

  fp16 = raw(plan.fp16, "fun")
  types = jax.eval_shape(fp16, state)
  if plan.fp32 is not None:
    fp32 = raw(plan.fp32, "fp32_fun")
    fp32_types = jax.eval_shape(fp32, state)
    # Compared whole: the passes return only the array leaves, in fun's structure.
    if trees["fun"] != trees["fp32_fun"]:
      raise ValueError(
        f"fun and fp32_fun must return the same pytree structure, got {trees['fun']} and "
        f"{trees['fp32_fun']}."
      )
    types = _calls.promoted(types, fp32_types, ("fun", "fp32_fun"))
  typed = lambda p: lambda at: _calls.cast(p(at), types)
  return typed(fp16), (None if plan.fp32 is None else typed(fp32)), statics[0]


def _try(plan: Plan, one_pass: Pass, at: LossScaleState, tries: jax.Array) -> Try:
  """``one_pass`` at ``at``, checked as ``tx.update`` checks it."""
  out = one_pass(at)
  value, grads = out
  loss = value[0]  # the first array leaf of fun's output: the loss, with or without aux
  finite, loss_finite, backed_off = _check(plan, grads, at, loss)
  # A non-finite loss is no overflow of the gradients: the next pass runs at the same state.
  after = jax.tree.map(functools.partial(jnp.where, loss_finite), backed_off, at)
  stuck = ~loss_finite | (backed_off.loss_scale == at.loss_scale)
  # Kept for tx.update, so that metrics name the loss even when update is not given it.
  record = jnp.where(loss_finite, at.nonfinite, backed_off.nonfinite)
  return Try(tries, finite, stuck, at, after, out, record)


def _check(
  plan: Plan, grads: Any, at: LossScaleState, loss: jax.Array
) -> tuple[jax.Array, jax.Array, LossScaleState]:
  """The check, whether the loss was finite, and the state after an overflow's back-off."""
  finite, backed_off = plan.update(grads, at._replace(inner_state=_transform.BackOff()), loss=loss)
  backed_off = backed_off._replace(inner_state=at.inner_state)
  # The record is kept as it was by a finite check: only a non-finite one speaks of this loss.
  loss_finite = finite | (backed_off.nonfinite[-2] == 0)
  if plan.axis_name is not None:
    loss_finite &= _numerics.all_finite(loss, plan.axis_name)
  return finite & loss_finite, loss_finite, backed_off


def _again(plan: Plan, last: Try) -> jax.Array:
  """Whether to run another float16 pass after ``last``."""
  return ~last.finite & ~last.stuck & (last.tries < plan.max_tries)


def _row_major(grads: Any) -> Any:
  """``grads`` pinned to row-major on the CPU, lest the retry branch's layouts reach every step."""

  def pin(g: jax.Array) -> jax.Array:  # jax.grad's leaves are floating arrays (no float0)
    return with_layout_constraint(g, Layout(tuple(range(g.ndim)))) if g.ndim >= 2 else g

  return lax.platform_dependent(grads, cpu=lambda t: jax.tree.map(pin, t), default=lambda t: t)
