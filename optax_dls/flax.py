"""Flax integration: loss-scaled ``value_and_grad`` for linen ``TrainState`` and ``nnx.Optimizer``,
and the port from flax's ``DynamicScale``.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._util import optional as _optional
from optax_dls._util import versions as _versions

_optional.require("flax", "optax_dls.flax")  # one line naming the extra when flax is missing
_versions.check_flax()  # before flax is used: a clear ImportError when it is too old

from flax import nnx

from optax_dls._access import find as _find
from optax_dls._core import multi_device as _multi_device
from optax_dls._features import recompute as _recompute
from optax_dls._integrations.dynamic_scale import from_dynamic_scale
from optax_dls._util import calls as _calls

__all__ = ["from_dynamic_scale", "value_and_grad"]

_OVERWRITE_WITH_GRADIENT = (
  "_overwrite_with_gradient"  # flax's key for gradient-overwritten (fp8) params
)


class _Spec(NamedTuple):
  """The arguments of :func:`value_and_grad`, checked."""

  fun: Callable[..., Any]
  fp32_fun: Callable[..., Any] | None
  max_tries: int
  argnums: int | tuple[int, ...]
  has_aux: bool
  axis_name: _multi_device.AxisName
  recomputes: bool  # max_tries given: the scale may move


def value_and_grad(
  fun: Callable[..., Any],
  *bound: Any,
  argnums: int | tuple[int, ...] = 0,
  has_aux: bool = False,
  max_tries: int | None = None,
  fp32_fun: Callable[..., Any] | None = None,
  axis_name: str | tuple[str, ...] | None = None,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad`` / ``nnx.value_and_grad``, with the loss scaled by S.

  The returned ``grad_fn(state, *args, **kwargs)`` takes the linen
  ``TrainState`` or the ``nnx.Optimizer`` first, reads the loss scale S of its
  optimizer state when called (so ``grad_fn`` may be built anywhere, once),
  and differentiates ``S * fun(*args, **kwargs)`` (Micikevicius et al. 2018,
  *Mixed Precision Training*). It returns the *unscaled* loss, exactly what
  ``fun`` returned, the *scaled* gradients, which the loss-scaled optimizer
  unscales, and the state to apply them to, the same call for both APIs::

      grad_fn = optax_dls.flax.value_and_grad(loss_fn, has_aux=True)

      ((loss, aux), grads), state = grad_fn(state, state.params, batch)  # linen
      state = state.apply_gradients(grads=grads)

      (loss, grads), optimizer = grad_fn(optimizer, model, batch)        # nnx
      optimizer.update(model, grads)

  ``fun`` returns the plain loss, a floating scalar (float16 is promoted to
  float32 before scaling, so the scaled loss cannot overflow), or ``(loss,
  aux)`` with ``has_aux=True``, and may take any keyword (``scale``
  included). When a differentiated argument is an ``nnx.Module`` the
  gradient is taken with respect to the optimizer's ``wrt`` variables
  (``nnx.Param`` by default), with the structure ``optimizer.update``
  expects; any other argument is differentiated as ``jax.value_and_grad``
  does. The ``nnx.Module`` arguments are split with ``nnx.split`` and merged
  back, so ``fun`` must not change their structure (add variables with
  ``sow``, assign a new ``Variable`` or attribute, delete one): a ``ValueError``
  names what changed.

  **A skipped step leaves the model as it was.** The module arguments'
  variables that the optimizer does not update (``BatchStat``, other
  non-``wrt`` variables, except the RNG state, which advances as
  ``optimizer.step`` does) get their values from ``fun`` only when the
  gradients are finite, the check ``optimizer.update`` makes: a step whose
  forward pass overflows does not write NaN into the batch statistics. It
  costs a select per element of those variables; without ``max_tries``, one
  more read of the gradients when there are such variables. For linen, keep
  the old ``batch_stats`` on a skipped step as ``optax_dls.metrics`` reports it::

      new = state.apply_gradients(grads=grads)
      skipped = optax_dls.metrics(new.opt_state)["skipped"]
      keep = lambda n, o: jnp.where(skipped, o, n)
      new = new.replace(batch_stats=jax.tree.map(keep, batch_stats, state.batch_stats))

  **Recomputing an overflowing step** (``max_tries`` given): when the
  gradients overflow, the step backs S off and computes them again for the
  same arguments, inside the same compiled step, as
  :func:`optax_dls.value_and_grad` does (up to ``max_tries`` more float16
  passes, then one with ``fp32_fun`` if given), so that no batch is lost.
  The gradients come back scaled by the new S, which the returned state
  carries: the ``TrainState`` with its ``opt_state`` replaced, or the
  ``nnx.Optimizer`` with its ``opt_state`` updated in place. Every try starts
  from the arguments as they were at the call (the same RNG state: the same
  dropout masks), and the module state the call leaves is the one of the try
  whose gradients are returned. Without ``max_tries`` the scale does not
  move: the returned state equals ``state``, except that a loss that was not
  finite is recorded in it, so that the update skips the step and backs off
  once (the gradients may be finite: a data term that is ``inf`` for one
  batch), as with ``max_tries``.

  **Several devices** (``axis_name``): under ``pmap`` / ``shard_map`` the
  gradients of every pass are averaged over ``axis_name`` with
  ``lax.pmean``, as flax's ``DynamicScale.value_and_grad(axis_name=...)``
  averages them (the loss is not averaged), so every device checks, retries
  and applies the same gradients. Build the transformation with the same
  ``axis_name``. Not needed under ``jit`` with ``NamedSharding``. Under
  ``shard_map`` with ``check_vma=True`` JAX's transpose has already summed the
  gradient of a replicated parameter over the axis, and ``pmean`` leaves
  that sum; average the loss in ``fun`` there for the mean.

  With :func:`optax_dls.no_loss_scale` (S = 1) the loss is multiplied by the
  state's scale, 1, and nothing is retried: a step is a plain
  ``jax.value_and_grad`` step's to rounding (a restored scale is divided out
  by the update).

  Args:
    fun: the loss function; its arguments are those of ``grad_fn`` after
      ``state``.
    *bound: must be empty: the state is passed to ``grad_fn`` when called,
      no longer here.
    argnums: int or tuple of ints, the positional arguments of ``fun`` to
      differentiate, counted in ``args`` (after ``state``). Default 0.
    has_aux: whether ``fun`` returns ``(loss, aux)``. Default False.
    max_tries: None (default: no recomputation) or an int in [0, 64], the
      float16 recomputations after the first pass.
    fp32_fun: optional, ``fun`` computed in float32, the last resort when
      every float16 try overflowed (same signature and outputs); needs
      ``max_tries``. Default None.
    axis_name: None (default), a mapped axis name or a tuple of names: the
      gradients are averaged over it.

  Returns:
    ``grad_fn(state, *args, **kwargs) -> ((value, grads), state)``, ``value``
    the loss (``(loss, aux)`` with ``has_aux``) and ``grads`` multiplied by S.

  Raises:
    TypeError: a second positional argument (the state now goes to
      ``grad_fn``); ``fun`` or ``fp32_fun`` not callable, ``has_aux`` not a
      bool, ``argnums`` not an int or tuple of ints, ``max_tries`` not an int,
      ``axis_name`` not a string or tuple of strings; when called, a first
      argument that is no ``TrainState`` or ``nnx.Optimizer`` (the message
      says when the arguments look swapped), a ``state.tx`` that is not the
      loss-scaled transformation itself, a non-floating loss, a ``fun`` that
      returns no ``(loss, aux)`` pair with ``has_aux=True``, fewer positional
      arguments than ``argnums`` asks for.
    ValueError: ``max_tries`` out of range, a negative or repeated
      ``argnums``, ``fp32_fun`` without ``max_tries``; when called, an
      optimizer state with no or several loss-scale states, or a ``fun``
      that added variables to its ``nnx.Module`` arguments.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls, optax_dls.flax
    >>> from flax.training.train_state import TrainState
    >>> state = TrainState.create(apply_fn=None, params={'w': jnp.ones(2)},
    ...   tx=optax_dls.dynamic_loss_scale(optax.adam(1e-3), init_scale=4.0))
    >>> grad_fn = optax_dls.flax.value_and_grad(lambda p: jnp.sum(p['w']))
    >>> (loss, grads), state = grad_fn(state, state.params)
    >>> float(loss), grads['w']  # the gradients times S = 4
    (2.0, Array([4., 4.], dtype=float32))
  """
  if bound:
    raise TypeError(
      "optax_dls.flax.value_and_grad(fun, ...) takes the TrainState or nnx.Optimizer when "
      "called, no longer when built: grad_fn = optax_dls.flax.value_and_grad(fun); "
      f"(loss, grads), state = grad_fn(state, *args); got {len(bound)} more positional "
      f"argument(s), the first a {type(bound[0]).__name__}."
    )
  tries, argnums, has_aux = _recompute.checked(
    fun, fp32_fun, 0 if max_tries is None else max_tries, argnums, has_aux
  )
  if fp32_fun is not None and max_tries is None:
    raise ValueError(
      "fp32_fun is the last resort of a recomputed step: pass max_tries too "
      "(e.g. max_tries=3), or drop fp32_fun."
    )
  spec = _Spec(
    fun,
    fp32_fun,
    tries,
    argnums,
    has_aux,
    _multi_device.check_axis_name(axis_name),
    max_tries is not None,
  )

  def grad_fn(state: Any, /, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], Any]:
    return _call(spec, state, args, kwargs)

  return grad_fn


def _call(
  spec: _Spec, state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, Any], Any]:
  """One call of ``grad_fn(state, *args, **kwargs)``."""
  is_nnx = _is_optimizer(state, args)
  _calls.check_reach(spec.argnums, args, "state")
  modules = _Modules.split(
    args, spec.argnums, getattr(state, "wrt", nnx.Param) if is_nnx else nnx.Param
  )
  plan = _recompute.make_plan(
    modules.pure(spec.fun, spec.has_aux),
    state.tx,
    fp32_fun=None if spec.fp32_fun is None else modules.pure(spec.fp32_fun, spec.has_aux),
    max_tries=spec.max_tries,
    argnums=spec.argnums,
    has_aux=True,
    axis_name=spec.axis_name,
    tx_name="state.tx",
  )
  # nnx: the plain arrays of the loss-scale state, written back into its Variables below.
  opt_state = _find.find_state(state.opt_state) if is_nnx else state.opt_state
  outcome = _recompute.call(plan, opt_state, modules.pure_args(args), kwargs)
  loss, (aux, after) = outcome.value
  modules.update(after, outcome.finite)
  value = (loss, aux) if spec.has_aux else loss
  return (value, outcome.grads), _new_state(state, is_nnx, outcome.opt_state)


def _is_train_state(x: Any) -> bool:
  return all(hasattr(x, f) for f in ("tx", "opt_state", "replace"))


def _is_optimizer(state: Any, args: tuple[Any, ...]) -> bool:
  """Whether ``state`` is an ``nnx.Optimizer`` (else a ``TrainState``); TypeError naming the
  calling order when it is neither."""
  if isinstance(state, nnx.Optimizer):
    return True
  if _is_train_state(state):
    return False
  is_state = lambda a: isinstance(a, nnx.Optimizer) or _is_train_state(a)
  raise TypeError(
    _calls.order_error(
      "state",
      "the flax TrainState or nnx.Optimizer",
      "is neither",
      "is one",
      state,
      _calls.first_index(args, is_state),
    )
  )


def _new_state(state: Any, is_nnx: bool, new: Any) -> Any:
  """The state to apply the gradients to: ``state`` with the optimizer state ``new`` (a new
  ``TrainState``; an ``nnx.Optimizer`` in place). Without ``max_tries`` the scale has not
  moved, but ``new`` may record a loss that was not finite, for the update to skip."""
  if is_nnx:
    _write_in_place(state.opt_state, new)
    return state
  return state.replace(opt_state=new)


class _Modules(NamedTuple):
  """The ``nnx.Module`` arguments of one call, as pure states: what is differentiated, the
  RNG state, and the other variables (kept as they were on a skipped step)."""

  modules: tuple[Any, ...]
  where: tuple[int, ...]  # their positions among the arguments
  diff: frozenset[int]  # those differentiated, as indices into ``where``
  is_diff: Callable[..., bool]
  graphdef: Any
  params: Any
  rng: Any
  other: Any

  @staticmethod
  def split(args: tuple[Any, ...], argnums: int | tuple[int, ...], wrt: Any) -> _Modules:
    nums = (argnums,) if isinstance(argnums, int) else argnums
    where = tuple(i for i, a in enumerate(args) if isinstance(a, nnx.Module))
    diff = frozenset(k for k, i in enumerate(where) if i in nums)
    in_wrt = nnx.filterlib.to_predicate(wrt)
    is_diff = lambda path, x: path[0] in diff and in_wrt(path[1:], x)
    modules = tuple(args[i] for i in where)
    graphdef, params, rng, other = nnx.split(modules, is_diff, nnx.RngState, ...)  # type: ignore[misc]
    return _Modules(modules, where, diff, is_diff, graphdef, params, rng, other)

  def pure_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each module replaced by its differentiated state (None if it is not)."""
    out = list(args)
    for k, i in enumerate(self.where):
      part = self.params[k] if k in self.params else nnx.State({})
      out[i] = part if k in self.diff else None
    return tuple(out)

  def pure(self, f: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``f`` on the pure arguments, returning ``(loss, (aux, after))``, ``after`` the RNG and
    other states the call leaves in the modules."""

    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
      merged = self._merged(args)
      full = list(args)
      for j, i in enumerate(self.where):
        full[i] = merged[j]
      loss, aux = _calls.loss_and_aux(f, has_aux, f(*full, **kwargs))
      if not self.where:
        return loss, (aux, None)
      graphdef, *states = nnx.split(merged, self.is_diff, nnx.RngState, ...)
      if graphdef != self.graphdef:  # at trace time: the modules' structure changed
        self._changed(states)
      return loss, (aux, tuple(states[1:]))

    return run

  def _changed(self, states: list[Any]) -> None:
    """ValueError naming what ``fun`` added to or removed from its module arguments."""
    changed = sorted(_paths(states) ^ _paths([self.params, self.rng, self.other]))
    raise ValueError(
      "fun added variables to its nnx.Module arguments (with sow, or by assigning new "
      "Variables or attributes) or removed some, which value_and_grad cannot merge back: "
      f"{changed or 'the modules changed structure'}. Return such values as aux "
      "(has_aux=True) instead."
    )

  def _merged(self, args: tuple[Any, ...]) -> Any:
    if not self.where:
      return ()
    parts = [
      nnx.State({j: args[i].raw_mapping}) for j, i in enumerate(self.where) if j in self.diff
    ]
    return _merge(self.graphdef, self.rng, self.other, *parts)

  def update(self, after: Any, finite: jax.Array) -> None:
    """Writes ``after`` into the modules: the RNG state, and the other variables where the
    gradients are ``finite`` (their old values otherwise)."""
    if not self.where:
      return
    rng, other = after
    nnx.update(
      self.modules, rng, jax.tree.map(lambda n, o: jnp.where(finite, n, o), other, self.other)
    )


def _paths(states: Any) -> set[str]:
  """The variables of ``states`` (the modules' differentiated, RNG and other states, each
  keyed by module), named ``"lin/bias"`` as :func:`optax_dls.nonfinite_leaves` names them."""
  key = lambda k: str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
  return {
    "/".join(key(k) for k in path[2:] if key(k) != "value")
    for path, _ in jax.tree_util.tree_leaves_with_path(states)
  }


def _merge(graphdef: Any, *states: Any) -> Any:
  """``nnx.merge`` into new Variables (flax >= 0.12 would otherwise reuse those in ``states``)."""
  return nnx.merge(graphdef, *states, **_MERGE_COPY)


_MERGE_COPY = {"copy": True} if "copy" in inspect.signature(nnx.merge).parameters else {}


def _write_in_place(opt_state: Any, new: Any) -> None:
  """Writes the leaves of ``new`` into the ``nnx.Variable`` leaves of ``opt_state``'s
  :class:`LossScaleState`, each in its own dtype."""
  (node,) = _find.find_all(opt_state)
  for var, value in zip(
    jax.tree.leaves(node, is_leaf=_find.is_variable), jax.tree.leaves(new), strict=True
  ):
    if hasattr(var, "set_value"):  # flax >= 0.12
      var.set_value(jnp.asarray(value, var.get_value().dtype))
    else:
      var.value = jnp.asarray(value, var.value.dtype)


def _apply_gradients(state: Any, *, grads: Any, **kwargs: Any) -> Any:
  """``state.apply_gradients(grads=grads, **kwargs)`` for a linen ``TrainState``,
  with the other fields kept as they were on a skipped step.

  The same ``state.tx.update`` and ``optax.apply_updates`` as the method,
  including flax's ``_overwrite_with_gradient`` collection. On a skipped step
  the parameters come back bit for bit (the updates are zero), and so does
  every array field given in ``kwargs`` (``batch_stats=`` from the step's
  forward pass, which may hold NaN when that pass overflowed): a skipped step
  leaves the whole model as it was. ``step`` advances by one either way, as
  with the method.

  Raises TypeError when ``state`` has no ``tx``, ``params`` or ``opt_state``, ValueError
  when ``state.opt_state`` holds no loss-scale state, or several.
  """
  if not all(hasattr(state, f) for f in ("tx", "params", "opt_state", "step", "replace")):
    raise TypeError(
      f"state must be a flax TrainState, got {type(state).__name__}: {repr(state)[:200]}."
    )
  overwrite = isinstance(grads, dict) and _OVERWRITE_WITH_GRADIENT in grads
  params = state.params["params"] if overwrite else state.params
  updates, opt_state = state.tx.update(
    grads["params"] if overwrite else grads, state.opt_state, params
  )
  params = optax.apply_updates(params, updates)
  if overwrite:
    params = {"params": params, _OVERWRITE_WITH_GRADIENT: grads[_OVERWRITE_WITH_GRADIENT]}
  finite = _find.find_state(opt_state).last_step_finite
  kept = {k: _kept(finite, v, getattr(state, k, None)) for k, v in kwargs.items()}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, **kept)


def _kept(finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the step was applied, ``old`` where it was skipped, leaf by leaf, for a
  field of arrays with ``old``'s structure and shapes; any other field is ``new``."""
  new_leaves, treedef = jax.tree.flatten(new)
  old_leaves, old_treedef = jax.tree.flatten(old)
  structure: Any = treedef
  alike = structure == old_treedef and all(
    isinstance(n, jax.Array) and jnp.shape(o) == n.shape for n, o in zip(new_leaves, old_leaves)
  )
  if not alike:
    return new
  return jax.tree.unflatten(
    treedef, [jnp.where(finite, n, o) for n, o in zip(new_leaves, old_leaves)]
  )
