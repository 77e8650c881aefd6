"""Gradient accumulation: loss scaling outside ``optax.MultiSteps``, never inside.

``dynamic_loss_scale(optax.MultiSteps(inner, k))`` checks each micro-batch
before it reaches the accumulator, so a non-finite micro-batch is dropped and
the scale backs off. The other order, ``MultiSteps(dynamic_loss_scale(inner),
k)``, adds every micro-batch to the accumulator first: one non-finite
micro-batch poisons it for good (0 * NaN = NaN). It is refused.
"""

from __future__ import annotations

from typing import Any

import optax

_WHY = (
  "MultiSteps(dynamic_loss_scale(...)). This order is not supported: MultiSteps adds every "
  "micro-batch to its accumulator before the loss scaler can check it, so one non-finite "
  "micro-batch poisons the accumulator for good (0 * NaN = NaN). Put the loss scaling "
  "outside: optax_dls.dynamic_loss_scale(optax.MultiSteps(inner, every_k_schedule=k)); "
  "a non-finite micro-batch is then dropped and the loss scale backs off."
)
MULTISTEPS_OUTSIDE = (
  f"opt_state is an optax.MultiSteps state wrapping a loss-scaled optimizer, {_WHY}"
)


def check_inner(inner: Any) -> optax.GradientTransformation:
  """The transformation to wrap: an ``optax.MultiSteps`` becomes its
  ``gradient_transformation()``; TypeError for anything that is not a transformation."""
  if isinstance(inner, optax.MultiSteps):
    inner = inner.gradient_transformation()
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"inner must be an optax.GradientTransformation, got {inner!r} of type "
      f"{type(inner).__name__}."
    )
  return inner


def refuse_multisteps_outside(tx: Any, name: str = "tx") -> None:
  """ValueError when ``tx`` is ``optax.MultiSteps`` around a loss-scaled transformation (the
  refused order), naming the supported one."""
  inner = getattr(tx, "_opt", None) if isinstance(tx, optax.MultiSteps) else None
  from optax_dls._core.transform import is_loss_scaled  # (transform imports this module)

  if inner is not None and is_loss_scaled(inner):
    raise ValueError(f"{name} is an optax.MultiSteps around a loss-scaled transformation, {_WHY}")


def is_multisteps_state(node: Any) -> bool:
  return isinstance(node, optax.MultiStepsState)
