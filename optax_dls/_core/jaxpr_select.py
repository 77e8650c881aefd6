"""Selecting each new state value where the inner update computes it: the skip of
``"auto"`` on the CPU.

The ``"where"`` skip runs the inner update on every step and keeps the old
state with ``jnp.where(finite, new, old)``. Selected at the end, the updates
(computed inside the inner update from the *new* state) would read the
unselected values while the selected ones overwrite the old state in place (a
donated state), and XLA's CPU backend copies the whole state first to order the
two (XLA's GPU backend fuses each selection into the kernel that computes the new
value, and the GPU program selects at the end). So the
inner update is evaluated from its jaxpr, equation by equation, and each new
state value is replaced by its selection right where it is computed: every
later use, the updates included, reads the selected value, as a bare
optimizer's updates read its new moments, and nothing is copied.

This relies on JAX's jaxpr interpreter interface, as ``jax.core.eval_jaxpr``
uses it: ``jax.make_jaxpr``, the ``jax.extend.core`` types ``Literal`` and
``Var``, and per equation ``eqn.primitive.bind`` with
``eqn.primitive.get_bind_params(eqn.params)`` inside ``eqn.ctx.manager``.
Higher-order primitives (nested ``jit``, ``custom_jvp`` / ``custom_vjp``,
``cond``, ``while``, ``scan``) are bound whole: a state value computed inside
one of them is selected where that primitive returns it. Effects (a debug
callback, say) are bound in their order. Outputs that are literals, constants,
inputs passed through, or repeated are selected at the end instead. If binding
any equation fails, the whole inner update runs as traced and every state
value is selected at the end: the same values, with the copy. An update with
effects is evaluated abstractly first, so that an effect bound before the
equation that fails does not run a second time in the fallback.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jax_core

from optax_dls._core import types as _types


def selected_at_definition(
  finite: jax.Array, apply: Callable[..., Any], grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """``apply(grads, inner_state, params) -> (out, new_state)`` with ``new_state``
  selected, ``jnp.where(finite, new, old)`` leaf by leaf, each leaf selected where
  ``apply`` computes it (see the module docstring).

  Args:
    finite: bool ``()``, the skip decision.
    apply: the inner update, returning ``(out, new_state)``; ``new_state`` has the
      tree structure of ``inner_state``.
    grads, inner_state, params: its arguments (pytrees).

  Returns:
    ``(out, new_state)``: ``out`` as ``apply`` computes it from the selected state.
  """
  closed, (out_shape, state_shape) = jax.make_jaxpr(apply, return_shape=True)(
    grads, inner_state, params
  )
  old = jax.tree.leaves(inner_state)
  args = jax.tree.leaves((grads, inner_state, params))
  n_out = len(jax.tree.leaves(out_shape))
  try:
    if closed.effects:  # bound once abstractly first: a failure runs no effect twice
      jax.make_jaxpr(lambda f, o, a: _evaluate(closed, f, o, a, n_out))(finite, old, args)
    out, new = _evaluate(closed, finite, old, args, n_out)
  except Exception:  # noqa: BLE001 (a construct the interpreter cannot bind: select at the end)
    out_tree, state_tree = apply(grads, inner_state, params)
    out, new = jax.tree.leaves(out_tree), jax.tree.leaves(state_tree)
    new = [_select(finite, n, o) for n, o in zip(new, old, strict=True)]
  out = jax.tree.unflatten(jax.tree.structure(out_shape), out)
  return out, jax.tree.unflatten(jax.tree.structure(state_shape), new)


def _select(finite: jax.Array, new: Any, old: Any) -> Any:
  return _types.select(finite, new, _types.like(old, new))


def _evaluate(
  closed: Any, finite: jax.Array, old: list[Any], args: list[Any], n_out: int
) -> tuple[list[Any], list[Any]]:
  """Evaluates ``closed`` on ``args``, selecting each state output where it is defined;
  returns the flat ``out`` and the flat selected state."""
  jaxpr = closed.jaxpr
  state_vars = jaxpr.outvars[n_out:]
  is_var = lambda v: isinstance(v, jax_core.Var)
  counts = collections.Counter(v for v in jaxpr.outvars if is_var(v))
  defined = {v for eqn in jaxpr.eqns for v in eqn.outvars}
  at_definition = {
    v: o for v, o in zip(state_vars, old) if is_var(v) and v in defined and counts[v] == 1
  }
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args, strict=True))

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  for eqn in jaxpr.eqns:
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    with eqn.ctx.manager:
      outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    for v, value in zip(eqn.outvars, outs, strict=True):
      env[v] = _select(finite, value, at_definition[v]) if v in at_definition else value
  out = [read(v) for v in jaxpr.outvars[:n_out]]
  new = [
    read(v) if is_var(v) and v in at_definition else _select(finite, _output(v, read), o)
    for v, o in zip(state_vars, old, strict=True)
  ]
  return out, new


def _output(v: Any, read: Callable[[Any], Any]) -> Any:
  """The value of state output ``v``; a weakly typed literal as the Python scalar it came
  from, so that its selection keeps the weak type the inner update returns."""
  if (
    isinstance(v, jax_core.Literal)
    and getattr(v.aval, "weak_type", False)
    and not getattr(v.aval, "shape", ())
  ):
    return v.val.item() if hasattr(v.val, "item") else v.val
  return read(v)
