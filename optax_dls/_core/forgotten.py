"""A forgotten ``scale_loss``, found when the step is traced.

A loss multiplied by the scale S gives gradients that depend on S: in the traced
program, S (the state's ``loss_scale``, an argument of the jitted step) is an ancestor
of every gradient. When a step computes its gradients and calls ``update`` in one
traced function and no gradient depends on S, the loss was not multiplied by it: each
update divides unscaled gradients by S (2**15 at the start), which Adam's
normalisation hides and SGD does not. ``update`` then warns, once per transformation.

The walk reads the tracers' ``parent`` equations (JAX's tracing records them); where a
JAX release has no such record, where the gradients are arguments of the traced
function (computed elsewhere) or the step runs eagerly, nothing is known and nothing
is said. It runs at trace time only; the compiled step does not contain it.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from optax_dls._util import frames as _frames

_LIMIT = 1_000_000  # equations walked at most (a very large program: nothing is said)


def scaled(grads: Any, scale: Any) -> bool | None:
  """Whether the floating leaves of ``grads`` were computed from a loss multiplied by
  ``scale``: True or False where they are computed in the trace ``scale`` belongs to
  (some depends on it, or none does), None where nothing is known (an eager step,
  gradients that are arguments of the traced function, a JAX without parent records, a
  walk too long)."""
  if not isinstance(scale, jax.core.Tracer) or not hasattr(scale, "parent"):
    return None
  trace = getattr(scale, "_trace", None)
  leaves = [
    g
    for g in jax.tree.leaves(grads)
    if isinstance(g, jax.core.Tracer)
    and getattr(g, "_trace", None) is trace
    and getattr(g, "parent", None) is not None
    and jax.numpy.issubdtype(g.dtype, jax.numpy.inexact)
  ]
  if trace is None or not leaves:
    return None
  return _depends_on(leaves, scale)


def warn_if_unscaled(grads: Any, scale: Any, told: list[bool]) -> None:
  """Warns (once: ``told`` is set) when :func:`scaled` finds that no gradient depends on
  ``scale``."""
  if told[0] or scaled(grads, scale) is not False:
    return
  told[0] = True
  warnings.warn(
    "optax_dls: no gradient this update receives depends on the loss scale in opt_state: "
    "the loss was not multiplied by optax_dls.scale_loss(loss, opt_state) before "
    "differentiation, so each update divides unscaled gradients by the scale (Adam hides "
    "it, SGD stalls). Return optax_dls.scale_loss(loss, opt_state) from the function you "
    "differentiate, or use optax_dls.value_and_grad(loss_fn, tx) "
    "(optax_dls.flax.value_and_grad for a TrainState or an nnx.Optimizer), which "
    "multiplies it.",
    UserWarning,
    stacklevel=_frames.user_stacklevel(),
  )


def _depends_on(leaves: list[Any], target: Any) -> bool | None:
  """Whether any of ``leaves`` depends on what ``target`` is computed from (the traced
  function's arguments it derives from: the state's own scale, or, for a state a
  recomputing ``value_and_grad`` returns, what its scale was chosen from); None when
  the walk is too long to tell."""
  roots = _arguments_of([target])
  if roots is None:
    return None
  return _reaches(leaves, lambda x: id(x) in roots)


def _arguments_of(tracers: list[Any]) -> set[int] | None:
  """The ids of the tracers without a ``parent`` (arguments, constants) ``tracers`` are
  computed from."""
  found: set[int] = set()

  def root(x: Any) -> bool:
    if getattr(x, "parent", None) is None:
      found.add(id(x))
    return False

  for x in tracers:
    root(x)
  return None if _reaches(tracers, root) is None else found


def _reaches(start: list[Any], hit: Any) -> bool | None:
  """Walks the equations ``start`` is computed by, back to the arguments: True at the first
  input ``hit`` accepts, False when none does, None when the walk is too long."""
  stack, seen = list(start), set()
  while stack:
    eqn = getattr(stack.pop(), "parent", None)
    if eqn is None or id(eqn) in seen:
      continue
    seen.add(id(eqn))
    inputs = getattr(eqn, "in_tracers", None)
    if inputs is None or len(seen) > _LIMIT:
      return None
    if any(hit(x) for x in inputs):
      return True
    stack.extend(inputs)
  return False
