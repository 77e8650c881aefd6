"""Choosing the float16 or the float32 computation inside the step, from the fallback's flag."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from optax_dls._access import find as _find
from optax_dls._policies.fallback import FallbackState
from optax_dls._util import calls as _calls
from optax_dls._util import validation as _validation


def _flag(opt_state: Any) -> jax.Array | None:
  state = _find.find_feature(opt_state, FallbackState)
  return None if state is None else state.fp32_fallback


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
    *args: passed to the chosen function: arrays, pytrees, or any Python
      values (a bool, a string, an object), which reach it as they are,
      under every policy.
    **kwargs: passed to the chosen function, likewise.

  Returns:
    The chosen function's output, each leaf cast to the promoted dtype of
    the two functions' outputs.

  Raises:
    TypeError: ``fp16_fn`` or ``fp32_fn`` is not callable.
    ValueError: the outputs differ in structure or shape, or ``opt_state``
      holds none or several loss-scale states.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=1)
    >>> state = optax_dls.loss_scaled(optax.sgd(0.1), policy).init({'w': jnp.ones(2)})
    >>> f16 = lambda x, double: (x * (2 if double else 1)).astype(jnp.float16)
    >>> f32 = lambda x, double: x * (2 if double else 1)
    >>> optax_dls.select_precision(state, f16, f32, jnp.ones(2), True)  # float16, then promoted
    Array([2., 2.], dtype=float32)
  """
  _validation.function("fp16_fn", fp16_fn)
  _validation.function("fp32_fn", fp32_fn)
  flag = _flag(opt_state)
  shapes = lambda fn: jax.eval_shape(lambda: fn(*args, **kwargs))
  types = _calls.promoted(shapes(fp16_fn), shapes(fp32_fn), ("fp16_fn", "fp32_fn"))
  # Only the array arguments are the conditional's operands; the others (Python bools,
  # strings, objects) are closed over, as a plain call would see them.
  arrays, rebuild = _calls.split_arrays((args, kwargs))

  def branch(fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    def run(operands: list[Any]) -> Any:
      a, k = rebuild(operands)
      return _calls.cast(fn(*a, **k), types)

    return run

  if flag is None:
    return branch(fp16_fn)(arrays)
  return lax.cond(flag, branch(fp32_fn), branch(fp16_fn), arrays)
