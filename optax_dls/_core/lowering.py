"""The two lowerings of the check and the skip, and the choice between them per platform.

Both make the same skip decisions, keep the same scales and counters, and leave
everything untouched on a skipped step bit for bit. The values of an applied
step agree to float32 rounding: XLA fuses, and may contract, the optimizer's
arithmetic differently in the two, so a few entries can differ in their last
bit, and such differences carry into later steps (as between any two
compilations of the same optimizer).

* ``"cond"``: the check is one read of each gradient leaf with an exact path in
  a ``lax.cond`` that runs only for a non-finite step
  (:func:`optax_dls._core.numerics.finite_and_norm`); the skip is a ``lax.cond`` that
  runs the inner update only on a finite step. The updates leave the
  conditional and are written out, so on the ``tx.update`` +
  ``optax.apply_updates`` path XLA cannot fuse them with the parameter update.
  On a GPU a conditional may read its predicate back to the host unless the
  runtime captures it in a graph.
* ``"where"``: no conditional. The check is one variadic reduction of each leaf
  (:func:`optax_dls._core.numerics.finite_and_norm_fused`); the inner update always
  runs, on gradients replaced by zeros on a skipped step, and ``jnp.where``
  at the end keeps the old value of every output, which XLA's GPU backend fuses
  into the optimizer's own kernels (one extra read of the gradients in all, the
  floor). On the CPU this copies the state.

``"auto"`` picks per platform with ``lax.platform_dependent``, from
measurements (see ``docs/guide/performance.md``): on the CPU the check of
``"cond"`` and the skip of ``"where"`` with each new state value selected where
the inner update computes it (:mod:`optax_dls._core.jaxpr_select`: XLA's CPU
backend copies the state for a selection at the end); ``"where"`` everywhere else. The
platform is the one the program is lowered for (``jax.export`` for another
platform gets that platform's choice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_dls._core import jaxpr_select as _jaxpr_select
from optax_dls._core import numerics as _numerics
from optax_dls._core import types as _types

LOWERINGS = ("auto", "cond", "where")
# What "auto" takes on each platform, as (check, skip); any other platform (a GPU, a TPU)
# gets "where", the plain program XLA's GPU backend fuses best. On the CPU: the one-read
# check of "cond" (a conditional costs nothing there) and the "where" skip with each new
# state value selected where the inner update computes it (XLA's CPU backend copies the
# state for a selection at the end).
AUTO = {"cpu": ("cond", "at_definition")}

# ``apply(grads, inner_state, params) -> (out, inner_state)``, the step's work, and
# ``skipped(params, out) -> out``, what it returns instead on a skipped step.
Apply = Callable[[Any, Any, Any], tuple[Any, Any]]
Skipped = Callable[[Any, Any], Any]


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


def by_cond(
  finite: jax.Array, apply: Apply, skipped: Skipped, grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """The skip as a ``lax.cond``: ``apply`` runs only when ``finite``; otherwise
  ``(skipped(params, out), inner_state)``, in the types ``apply`` returns."""

  def skip(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
    out, new_s = jax.eval_shape(apply, g, s, p)
    return skipped(p, out), jax.tree.map(_types.like, s, new_s)

  return lax.cond(finite, apply, skip, grads, inner_state, params)


def by_where(
  finite: jax.Array, apply: Apply, skipped: Skipped, grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """The skip as a selection: ``apply`` always runs, on zeros where the step is not
  finite, and ``jnp.where(finite, new, old)`` at the end keeps the old state and gives
  ``skipped(params, out)`` on a skipped step. XLA's GPU backend fuses each selection into
  the kernel that computes the new value."""
  safe = jax.tree.map(lambda g: _types.select(finite, g, jnp.zeros_like(g)), grads)
  out, new_s = apply(safe, inner_state, params)
  keep = lambda new, old: _types.select(finite, new, _types.like(old, new))
  return _replaced(finite, skipped, params, out), jax.tree.map(keep, new_s, inner_state)


def by_where_at_definition(
  finite: jax.Array, apply: Apply, skipped: Skipped, grads: Any, inner_state: Any, params: Any
) -> tuple[Any, Any]:
  """:func:`by_where` with each new state value selected where ``apply`` computes it
  (:mod:`optax_dls._core.jaxpr_select`): the same values, and on the CPU no copy of the
  state."""
  safe = jax.tree.map(lambda g: _types.select(finite, g, jnp.zeros_like(g)), grads)
  out, new_s = _jaxpr_select.selected_at_definition(finite, apply, safe, inner_state, params)
  return _replaced(finite, skipped, params, out), new_s


def _replaced(finite: jax.Array, skipped: Skipped, params: Any, out: Any) -> Any:
  """``out`` on a finite step, ``skipped(params, out)`` otherwise."""
  replaced = skipped(params, out)
  return jax.tree.map(lambda new, old: _types.select(finite, new, old), out, replaced)


class Lowering(NamedTuple):
  """How the check and the skip are compiled.

  Attributes:
    check: ``(grads, scale, axis_name, want_amax) -> Check``.
    select: ``(finite, apply, skipped, grads, inner_state, params) -> (out, inner_state)``.
  """

  check: Callable[..., _numerics.Check]
  select: Callable[..., tuple[Any, Any]]


COND = Lowering(_numerics.finite_and_norm, by_cond)
WHERE = Lowering(_numerics.finite_and_norm_fused, by_where)
_BY_NAME = {"cond": COND, "where": WHERE}
# The parts "auto" chooses from: checks and skips by name.
_CHECKS = {"cond": COND.check, "where": WHERE.check}
_SKIPS = {"cond": by_cond, "where": by_where, "at_definition": by_where_at_definition}


def _branches(part: int, run: Callable[..., Any]) -> dict[str, Any]:
  """``lax.platform_dependent`` branches running ``run(fn, *operands)`` with the check
  (``part`` 0) or the skip (``part`` 1) :data:`AUTO` names per platform."""
  named = _SKIPS if part else _CHECKS
  branch = lambda fn: functools.partial(run, fn)
  return {
    "default": branch(named["where"]),
    **{platform: branch(named[how[part]]) for platform, how in AUTO.items()},
  }


def _same_everywhere(part: int) -> bool:
  """Whether every platform takes the default's part: then there is nothing to choose,
  and the program is traced once."""
  return all(how[part] == "where" for how in AUTO.values())


def auto_check(
  grads: Any, scale: jax.Array, axis_name: Any = None, want_amax: bool = False
) -> _numerics.Check:
  """The check of :data:`AUTO`'s lowering for the platform the program is lowered for."""
  if _same_everywhere(0):
    return WHERE.check(grads, scale, axis_name, want_amax)
  branches = _branches(0, lambda check, g, s: check(g, s, axis_name, want_amax))
  return lax.platform_dependent(grads, scale, **branches)


def auto_select(
  finite: jax.Array, apply: Apply, skipped: Skipped, *operands: Any
) -> tuple[Any, Any]:
  """The skip of :data:`AUTO`'s lowering for the platform the program is lowered for."""
  if _same_everywhere(1):
    return WHERE.select(finite, apply, skipped, *operands)
  branches = _branches(1, lambda select, f, *ops: select(f, apply, skipped, *ops))
  return lax.platform_dependent(finite, *operands, **branches)


AUTO_LOWERING = Lowering(auto_check, auto_select)


def lowering(name: Any) -> Lowering:
  """The :class:`Lowering` named ``name`` (checked: TypeError / ValueError)."""
  name = check_lowering(name)
  return AUTO_LOWERING if name == "auto" else _BY_NAME[name]
