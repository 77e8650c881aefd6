"""Choosing the float16 or the float32 computation inside the step, from the fallback's flag."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_dls import _access, _validation
from optax_dls._policies.fallback import FallbackState


def _flag(opt_state: Any) -> jax.Array | None:
  state = _access.find_feature(opt_state, FallbackState)
  return None if state is None else state.fp32_fallback


def _common_dtypes(fn_a: Callable, fn_b: Callable, args: tuple, kwargs: dict) -> Any:
  out_a = jax.eval_shape(lambda: fn_a(*args, **kwargs))
  out_b = jax.eval_shape(lambda: fn_b(*args, **kwargs))
  if jax.tree.structure(out_a) != jax.tree.structure(out_b):
    raise ValueError(
      "fp16_fn and fp32_fn must return the same pytree structure, got "
      f"{jax.tree.structure(out_a)} and {jax.tree.structure(out_b)}."
    )
  for a, b in zip(jax.tree.leaves(out_a), jax.tree.leaves(out_b)):
    if a.shape != b.shape:
      raise ValueError(f"fp16_fn and fp32_fn outputs differ in shape: {a.shape} vs {b.shape}.")
  return jax.tree.map(lambda a, b: jnp.promote_types(a.dtype, b.dtype), out_a, out_b)


def select_precision(
  opt_state: Any, fp16_fn: Callable, fp32_fn: Callable, *args: Any, **kwargs: Any
) -> Any:
  """Calls ``fp32_fn(*args, **kwargs)`` while the fallback is on, else ``fp16_fn``.

  Both functions are traced once and chosen inside the compiled step with
  ``lax.cond`` on the :func:`fp32_fallback` flag, so switching precision
  never recompiles. Outputs must have the same structure and shapes; each
  leaf is cast to the promoted dtype of the two (e.g. a float16 and a
  float32 loss both come back float32).

  Args:
    opt_state: an optimizer state holding one :class:`LossScaleState`, whose
      policy is wrapped by :func:`fp32_fallback` (otherwise ``fp16_fn``
      always runs).
    fp16_fn: the computation in float16.
    fp32_fn: the same computation in float32.
    *args: passed to the chosen function (arrays, or pytrees).
    **kwargs: passed to the chosen function.

  Raises:
    TypeError: ``fp16_fn`` or ``fp32_fn`` is not callable.
    ValueError: the outputs differ in structure or shape, or ``opt_state``
      holds none or several loss-scale states.
  """
  _validation.function("fp16_fn", fp16_fn)
  _validation.function("fp32_fn", fp32_fn)
  flag = _flag(opt_state)
  dtypes = _common_dtypes(fp16_fn, fp32_fn, args, kwargs)

  def branch(fn):
    def run(operands):
      a, k = operands
      return jax.tree.map(lambda x, d: jnp.asarray(x).astype(d), fn(*a, **k), dtypes)

    return run

  if flag is None:
    return branch(fp16_fn)((args, kwargs))
  return lax.cond(flag, branch(fp32_fn), branch(fp16_fn), (args, kwargs))
