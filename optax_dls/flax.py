"""Flax integration (the ``flax`` extra): loss-scaled ``value_and_grad`` for a linen ``TrainState``
and an ``nnx.Optimizer``, and the port from flax's ``DynamicScale``. Their ``step`` counts skipped
steps too: the applied ones are ``num_steps - skip_count`` in ``metrics``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_dls._util import optional as _optional
from optax_dls._util import versions as _versions

_optional.require("flax", "optax_dls.flax")  # one line naming the extra when flax is missing
_versions.check_flax()  # before flax is used: a clear ImportError when it is too old

from flax import nnx

from optax_dls._access import find as _find
from optax_dls._core import multi_device as _multi_device
from optax_dls._features import recompute as _recompute
from optax_dls._integrations.carry import from_dynamic_scale
from optax_dls._util import calls as _calls

__all__ = ["from_dynamic_scale", "value_and_grad"]


def value_and_grad(
  fun: Callable[..., Any],
  *bound: Any,
  argnums: int | tuple[int, ...] = 0,
  has_aux: bool = False,
  max_tries: int | None = None,
  fp32_fun: Callable[..., Any] | None = None,
  axis_name: str | tuple[str, ...] | None = None,
) -> Callable[..., Any]:
  """:func:`optax_dls.value_and_grad` for a linen ``TrainState`` or an ``nnx.Optimizer``.

  ``grad_fn(state, *args, **kwargs)`` reads the loss scale S of the ``TrainState`` or
  ``nnx.Optimizer`` and differentiates ``S * fun(*args, **kwargs)`` (Micikevicius et al. 2018,
  *Mixed Precision Training*) as :func:`optax_dls.value_and_grad` does (see also
  ``docs/guide/flax.md``); ``state.apply_gradients`` / ``optimizer.update`` unscale the gradients.

  An ``nnx.Module`` argument is differentiated with respect to the optimizer's ``wrt`` variables
  (``nnx.Param`` by default) and merged back: ``fun`` must not change its structure (``sow``, a
  new ``Variable`` or attribute). **A skipped step leaves the model as it was**: non-``wrt``
  variables (``BatchStat``) take ``fun``'s values only where the gradients are finite; the RNG
  state advances. For linen, keep ``batch_stats`` where ``metrics(new.opt_state)["skipped"]``.

  Args:
    fun: the loss function; its arguments are those of ``grad_fn`` after ``state``.
    *bound: must be empty: the state is passed to ``grad_fn`` when called, no longer here.
    argnums: int or tuple of ints, the positional arguments of ``fun`` to differentiate, counted in
      ``args`` (after ``state``). Default 0.
    has_aux: whether ``fun`` returns ``(loss, aux)``. Default False.
    max_tries: None (default: no recomputation; ``state`` comes back as it was, but for a
      non-finite loss recorded) or an int in [0, 64], the float16 recomputations after the first
      pass, each from the arguments as given; the state returned then carries the new S (a new
      ``TrainState``; the ``nnx.Optimizer`` updated in place).
    fp32_fun: optional, ``fun`` computed in float32, the last resort when every float16 try
      overflowed (same signature and outputs); needs ``max_tries``. Default None.
    axis_name: None (default), a mapped axis name or a tuple of names: under ``pmap`` /
      ``shard_map`` every pass's gradients (not the loss) are averaged over it, as flax's
      ``DynamicScale`` does. Under ``shard_map(check_vma=True)`` JAX has already summed a
      replicated parameter's gradient: average the loss in ``fun`` there.

  Returns:
    ``grad_fn(state, *args, **kwargs) -> ((value, grads), state)``, ``value`` the loss
    (``(loss, aux)`` with ``has_aux``) and ``grads`` multiplied by S.

  Raises:
    TypeError: what :func:`optax_dls.value_and_grad` raises it for (with ``state.tx``), and a second
      positional argument (the state goes to ``grad_fn``), ``axis_name`` not a string or tuple of
      strings, a first argument to ``grad_fn`` that is no ``TrainState`` or ``nnx.Optimizer`` (the
      message says when the arguments look swapped).
    ValueError: what :func:`optax_dls.value_and_grad` raises it for, and ``fp32_fun`` without
      ``max_tries``, a ``fun`` that changed its ``nnx.Module`` arguments' variables.

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
  axis_name = _multi_device.check_axis_name(axis_name)

  def grad_fn(state: Any, /, *args: Any, **kwargs: Any) -> tuple[tuple[Any, Any], Any]:
    is_nnx = _is_optimizer(state, args)
    _calls.check_reach(argnums, args, "state")
    wrt = getattr(state, "wrt", nnx.Param) if is_nnx else nnx.Param
    modules = _Modules.split(args, argnums, wrt)
    plan = _recompute.make_plan(
      modules.pure(fun, has_aux),
      state.tx,
      fp32_fun=None if fp32_fun is None else modules.pure(fp32_fun, has_aux),
      max_tries=tries,
      argnums=argnums,
      has_aux=True,
      axis_name=axis_name,
      tx_name="state.tx",
    )
    # nnx: the loss-scale state's plain arrays, written back into its Variables below.
    opt_state = _find.find_state(state.opt_state) if is_nnx else state.opt_state
    outcome = _recompute.call(plan, opt_state, modules.pure_args(args), kwargs)
    loss, (aux, after) = outcome.value
    modules.update(after, outcome.finite)
    value = (loss, aux) if has_aux else loss
    if is_nnx:
      _write_in_place(state.opt_state, outcome.opt_state)
    else:
      state = state.replace(opt_state=outcome.opt_state)
    return (value, outcome.grads), state

  return grad_fn


def _is_train_state(x: Any) -> bool:
  return all(hasattr(x, f) for f in ("tx", "opt_state", "replace"))


def _is_optimizer(state: Any, args: tuple[Any, ...]) -> bool:
  """Whether ``state`` is an ``nnx.Optimizer`` (else a ``TrainState``); TypeError otherwise."""
  if isinstance(state, nnx.Optimizer):
    return True
  if _is_train_state(state):
    return False
  is_state = lambda a: isinstance(a, nnx.Optimizer) or _is_train_state(a)
  words = ("state", "the flax TrainState or nnx.Optimizer", "is neither", "is one")
  raise TypeError(_calls.order_error(*words, state, _calls.first_index(args, is_state)))


class _Modules(NamedTuple):
  """The ``nnx.Module`` arguments of one call as pure states: differentiated, RNG and other."""

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
      out[i] = (self.params[k] if k in self.params else nnx.State({})) if k in self.diff else None
    return tuple(out)

  def pure(self, f: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``f`` on the pure arguments: ``(loss, (aux, after))``, ``after`` the RNG and other states."""

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
        changed = sorted(_paths(states) ^ _paths([self.params, self.rng, self.other]))
        raise ValueError(
          "fun added variables to its nnx.Module arguments (with sow, or by assigning new "
          "Variables or attributes) or removed some, which value_and_grad cannot merge back: "
          f"{changed or 'the modules changed structure'}. Return such values as aux "
          "(has_aux=True) instead."
        )
      return loss, (aux, tuple(states[1:]))

    return run

  def _merged(self, args: tuple[Any, ...]) -> Any:
    if not self.where:
      return ()
    parts = [
      nnx.State({j: args[i].raw_mapping}) for j, i in enumerate(self.where) if j in self.diff
    ]
    # New Variables: flax >= 0.12 would otherwise reuse those in the states.
    return nnx.merge(self.graphdef, self.rng, self.other, *parts, **_MERGE_COPY)

  def update(self, after: Any, finite: jax.Array) -> None:
    """Writes ``after``'s RNG state into the modules, its other variables where ``finite``."""
    if not self.where:
      return
    rng, other = after
    nnx.update(
      self.modules, rng, jax.tree.map(lambda n, o: jnp.where(finite, n, o), other, self.other)
    )


def _paths(states: Any) -> set[str]:
  """The variables of ``states`` named ``"lin/bias"``, as ``nonfinite_leaves`` names them."""
  key = lambda k: str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
  return {
    "/".join(key(k) for k in path[2:] if key(k) != "value")
    for path, _ in jax.tree_util.tree_leaves_with_path(states)
  }


_MERGE_COPY = {"copy": True} if "copy" in inspect.signature(nnx.merge).parameters else {}


def _write_in_place(opt_state: Any, new: Any) -> None:
  """Writes ``new`` into the ``nnx.Variable`` leaves of ``opt_state``'s LossScaleState."""
  (node,) = _find.find_all(opt_state)
  for var, value in zip(
    jax.tree.leaves(node, is_leaf=_find.is_variable), jax.tree.leaves(new), strict=True
  ):
    if hasattr(var, "set_value"):  # flax >= 0.12
      var.set_value(jnp.asarray(value, var.get_value().dtype))
    else:
      var.value = jnp.asarray(value, var.value.dtype)
