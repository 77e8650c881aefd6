"""The skip: apply the inner update on a finite step, leave everything untouched otherwise.

Two lowerings, which give bit-identical parameters, optimizer states and scales
(only the stored gradient norm of a step whose squares overflow float32 may
differ in its last bits, see :func:`optax_dls._numerics.finite_and_norm_fused`):

* ``"cond"``: a ``lax.cond`` runs the inner update only on a finite step; a
  skipped step does no optimizer work. The updates leave the conditional and
  are written out, so on the ``tx.update`` + ``optax.apply_updates`` path XLA
  cannot fuse them with the parameter update. On a GPU a conditional may
  read its predicate back to the host unless the runtime captures it in a
  graph.
* ``"where"``: the inner update always runs, on gradients replaced by zeros
  on a skipped step, and a ``jnp.where`` selects the new or the old value of
  every output, fused into the optimizer's own elementwise work. No
  conditional, so no predicate ever leaves the device.

``"auto"`` picks one per platform with ``lax.platform_dependent``, from
measurements (see ``docs/guide/performance.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_dls import _multi_device as md
from optax_dls import _numerics

LOWERINGS = ("auto", "cond", "where")
# The default lowering of each platform under "auto"; any other platform gets "where".
AUTO = {"cpu": "cond"}


def check_lowering(lowering: Any) -> str:
  """``lowering`` if it is one of :data:`LOWERINGS`; TypeError / ValueError otherwise."""
  if not isinstance(lowering, str):
    raise TypeError(f"skip_lowering must be one of {LOWERINGS}, got {lowering!r} of type "
                    f"{type(lowering).__name__}.")
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
  return md.vary_like(x, target)


def zeros_like(target: Any) -> Any:
  """Zeros of ``target``'s type: shape, dtype, sharding (``Explicit`` mesh axes
  included) and the mesh axes it varies over."""
  return md.vary_like(jnp.zeros_like(target), target)


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


def by_cond(finite: jax.Array, apply: Callable, skipped: Callable, grads: Any, inner_state: Any,
            params: Any) -> tuple[Any, Any]:
  """The skip as a ``lax.cond``: ``apply(grads, inner_state, params) -> (out, inner_state)``
  runs only when ``finite``; otherwise ``(skipped(params, out), inner_state)``."""

  def skip(g, s, p):
    out, new_s = jax.eval_shape(apply, g, s, p)
    return skipped(p, out), jax.tree.map(like, s, new_s)

  return lax.cond(finite, apply, skip, grads, inner_state, params)


def by_where(finite: jax.Array, apply: Callable, skipped: Callable, grads: Any, inner_state: Any,
             params: Any) -> tuple[Any, Any]:
  """The skip as a selection: ``apply`` always runs, on zeros where ``grads`` are
  not finite, and ``jnp.where`` keeps the old values on a skipped step."""
  safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
  out, new_s = apply(safe, inner_state, params)
  keep = lambda new, old: jnp.where(finite, new, like(old, new))
  return jax.tree.map(keep, out, skipped(params, out)), jax.tree.map(keep, new_s, inner_state)


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
  """The :class:`Lowering` named ``name``; ``"auto"`` dispatches each part per
  platform with ``lax.platform_dependent`` (see :data:`AUTO`)."""
  name = check_lowering(name)
  if name != "auto":
    return _BY_NAME[name]

  def per_platform(run):
    """``run(lowering, *operands)`` dispatched on the platform the program is compiled for."""
    branch = lambda how: functools.partial(run, how)
    return lambda *operands: lax.platform_dependent(
        *operands, default=branch(WHERE), **{p: branch(_BY_NAME[how]) for p, how in AUTO.items()})

  def check(grads, scale, axis_name):
    return per_platform(lambda how, g, s: how.check(g, s, axis_name))(grads, scale)

  def select(finite, apply, skipped, *operands):
    return per_platform(lambda how, f, *ops: how.select(f, apply, skipped, *ops))(finite, *operands)

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
