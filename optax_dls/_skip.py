"""The skip: apply the inner update on a finite step, leave everything untouched otherwise.

Two lowerings, which make the same skip decisions, keep the same scales and
counters, and leave everything untouched on a skipped step bit for bit. The
values of an applied step agree to float32 rounding: XLA fuses, and may
contract, the optimizer's arithmetic differently in the two, so a few entries
can differ in their last bit, and such differences carry into later steps (as
between any two compilations of the same optimizer). The stored gradient norm
of a step whose squares overflow float32 may differ in its last bits too, see
:func:`optax_dls._numerics.finite_and_norm_fused`:

* ``"cond"``: a ``lax.cond`` runs the inner update only on a finite step; a
  skipped step does no optimizer work. The updates leave the conditional and
  are written out, so on the ``tx.update`` + ``optax.apply_updates`` path XLA
  cannot fuse them with the parameter update. On a GPU a conditional may
  read its predicate back to the host unless the runtime captures it in a
  graph.
* ``"where"``: the inner update always runs, on gradients replaced by zeros
  on a skipped step, and a ``jnp.where`` selects the new or the old value of
  every output, fused into the optimizer's own elementwise work. Each new
  state value is selected where the inner update computes it, so the updates
  are computed from the selected state, as a bare optimizer computes them
  from its new state: nothing is copied, and on the ``tx.update`` +
  ``optax.apply_updates`` path the updates fuse with the parameter update.
  No conditional, so no predicate ever leaves the device.

``"auto"`` picks the check and the skip per platform with
``lax.platform_dependent``, from measurements (see ``docs/guide/performance.md``):
on the CPU the check of ``"cond"`` and the skip of ``"where"``; ``"where"``
everywhere else.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend import core as jax_core

from optax_dls import _multi_device, _numerics

LOWERINGS = ("auto", "cond", "where")
# What "auto" takes on each platform, as (check, skip); any other platform gets "where"'s.
# On the CPU: the one-read check of "cond" (a conditional costs nothing there, the
# sibling reductions of the fused check are separate reads) and the skip of "where".
AUTO = {"cpu": ("cond", "where")}


def check_lowering(lowering: Any) -> str:
  """``lowering`` if it is one of :data:`LOWERINGS`; TypeError / ValueError otherwise."""
  if not isinstance(lowering, str):
    raise TypeError(
      f"skip_lowering must be one of {LOWERINGS}, got {lowering!r} of type "
      f"{type(lowering).__name__}."
    )
  if lowering not in LOWERINGS:
    raise ValueError(f"skip_lowering must be one of {LOWERINGS}, got skip_lowering={lowering!r}.")
  return lowering


def like(x: Any, target: Any) -> Any:
  """``x`` given ``target``'s dtype and the mesh axes it varies over: an old
  value of the inner state made to match what the inner update returns (it
  may widen a dtype on its first update, e.g. float16 moments to float32)."""
  if not hasattr(x, "dtype") or not hasattr(target, "dtype"):
    return x
  x = x if x.dtype == target.dtype else x.astype(target.dtype)
  return _multi_device.vary_like(x, target)


def zeros_like(target: Any) -> Any:
  """Zeros of ``target``'s type: shape, dtype, sharding (``Explicit`` mesh axes
  included) and the mesh axes it varies over."""
  return _multi_device.vary_like(jnp.zeros_like(target), target)


# What a step returns: the updates (``tx.update``) or the new parameters
# (``apply_step``), and what it returns instead on a skipped step.
def updates_out(params: Any, updates: Any) -> Any:
  del params
  return updates


def updates_skipped(params: Any, out: Any) -> Any:
  del params
  return jax.tree.map(zeros_like, out)


def params_out(params: Any, updates: Any) -> Any:
  return optax.apply_updates(params, updates)


def params_skipped(params: Any, out: Any) -> Any:
  del out
  return params  # bit for bit (adding zeros would turn -0.0 into 0.0)


def by_cond(
  finite: jax.Array, apply: Callable, skipped: Callable, grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """The skip as a ``lax.cond``: ``apply(grads, inner_state, params) -> (out, inner_state)``
  runs only when ``finite``; otherwise ``(skipped(params, out), inner_state)``."""

  def skip(g, s, p):
    out, new_s = jax.eval_shape(apply, g, s, p)
    return skipped(p, out), jax.tree.map(like, s, new_s)

  return lax.cond(finite, apply, skip, grads, inner_state, params)


def by_where(
  finite: jax.Array, apply: Callable, skipped: Callable, grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """The skip as a selection: ``apply`` always runs, on zeros where ``grads`` are
  not finite, and ``jnp.where`` keeps the old values on a skipped step.

  Each new state value is selected where ``apply`` computes it
  (:func:`selected_at_definition`), so that what ``apply`` derives from it
  (the updates, the new parameters) reads the selected value, as the bare
  optimizer reads its new moments: the state is written in place and the
  updates fuse with whatever consumes them. Equal to selecting at the end:
  on a finite step every selection is the identity; on a skipped step the
  outputs are replaced by ``skipped`` and the old state anyway."""
  safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
  out, new_s = selected_at_definition(finite, apply, safe, inner_state, params)
  return jax.tree.map(
    lambda new, old: jnp.where(finite, new, old), out, skipped(params, out)
  ), new_s


def selected_at_definition(
  finite: jax.Array, apply: Callable, grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """``apply(grads, inner_state, params) -> (out, new_state)`` with ``new_state``
  selected, ``jnp.where(finite, new, old)`` leaf by leaf. ``apply`` is evaluated
  from its jaxpr, each new state leaf selected where it is computed, so that
  every later use inside ``apply`` reads the selected value.

  Without this, XLA sees the updates read the old state while the new state
  overwrites it in place (a donated state), and copies the whole state first.
  A leaf that ``apply`` passes through from its inputs, or returns in two
  places, is selected at the end instead."""
  closed, (out_shapes, state_shapes) = jax.make_jaxpr(apply, return_shape=True)(
    grads, inner_state, params
  )
  jaxpr = closed.jaxpr
  n_out = len(jax.tree.leaves(out_shapes))
  state_vars, old_leaves = jaxpr.outvars[n_out:], jax.tree.leaves(inner_state)
  counts = collections.Counter(state_vars)
  defined = {var for eqn in jaxpr.eqns for var in eqn.outvars}
  old_of = {
    var: old
    for var, old in zip(state_vars, old_leaves)
    if isinstance(var, jax_core.Var) and var in defined and counts[var] == 1
  }
  select = lambda new, old: jnp.where(finite, new, like(old, new))
  env: dict = {}
  read = lambda var: var.val if isinstance(var, jax_core.Literal) else env[var]
  env.update(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, jax.tree.leaves((grads, inner_state, params))))
  for eqn in jaxpr.eqns:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    with eqn.ctx.manager:
      outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
    for var, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
      env[var] = select(value, old_of[var]) if var in old_of else value
  out = jax.tree.unflatten(
    jax.tree.structure(out_shapes), [read(var) for var in jaxpr.outvars[:n_out]]
  )
  new_state = [
    read(var) if var in old_of else select(read(var), old)
    for var, old in zip(state_vars, old_leaves)
  ]
  return out, jax.tree.unflatten(jax.tree.structure(state_shapes), new_state)


class Lowering(NamedTuple):
  """How the check and the skip are compiled.

  Attributes:
    check: ``(grads, scale, axis_name) -> (finite, grad_norm)``.
    select: ``(finite, apply, skipped, grads, inner_state, params) -> (out, inner_state)``.
  """

  check: Callable
  select: Callable


COND = Lowering(_numerics.finite_and_norm, by_cond)
WHERE = Lowering(_numerics.finite_and_norm_fused, by_where)
_BY_NAME = {"cond": COND, "where": WHERE}


def lowering(name: Any) -> Lowering:
  """The :class:`Lowering` named ``name``; ``"auto"`` dispatches the check and the
  skip per platform with ``lax.platform_dependent`` (see :data:`AUTO`)."""
  name = check_lowering(name)
  if name != "auto":
    return _BY_NAME[name]

  def per_platform(part, run):
    """``run(lowering, *operands)`` dispatched on the platform the program is compiled for,
    with the lowering :data:`AUTO` names for ``part`` (0: the check, 1: the skip)."""
    branch = lambda how: functools.partial(run, how)
    return lambda *operands: lax.platform_dependent(
      *operands,
      default=branch(WHERE),
      **{p: branch(_BY_NAME[how[part]]) for p, how in AUTO.items()},
    )

  def check(grads, scale, axis_name):
    return per_platform(0, lambda how, g, s: how.check(g, s, axis_name))(grads, scale)

  def select(finite, apply, skipped, *operands):
    return per_platform(1, lambda how, f, *ops: how.select(f, apply, skipped, *ops))(
      finite, *operands
    )

  return Lowering(check, select)


def settled_init(inner: optax.GradientTransformationExtraArgs, params: Any) -> Any:
  """``inner.init(params)`` with each leaf widened to the dtype the first update
  gives it, so that the state's types are a fixed point from the start (no
  retrace after the first step). Left as ``init`` made it where the update
  cannot be traced without its extra arguments."""
  state = inner.init(params)
  try:
    _, after = jax.eval_shape(inner.update, params, state, params)
  except Exception:  # noqa: BLE001 (e.g. an update that needs extra arguments)
    return state
  if jax.tree.structure(after) != jax.tree.structure(state):
    return state
  return jax.tree.map(like, state, after)
