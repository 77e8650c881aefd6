"""Float32 fallback: run the loss in float32 for a while after a run of skipped steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_dls import _validation as v
from optax_dls._access import find_state
from optax_dls._policy import SCALE_MAX, SCALE_MIN


class FallbackConfig:
  """Checked fallback settings (static; closed over by the transformation)."""

  def __init__(self, after: Any, steps: Any, scale: Any):
    # ``after=None`` (fallback off) still checks ``steps`` and ``scale``.
    self.after = None if after is None else v.integer("fallback_after", after)
    if self.after is not None:
      v.check(1 <= self.after <= v.INT32_MAX, "fallback_after", self.after, "1 <= value <= 2**31 - 1")
    self.steps = v.integer("fallback_steps", steps)
    v.check(1 <= self.steps <= v.INT32_MAX, "fallback_steps", self.steps, "1 <= value <= 2**31 - 1")
    self.scale = None
    if scale is not None:
      self.scale = v.real("fallback_scale", scale)
      v.check(SCALE_MIN <= self.scale <= SCALE_MAX, "fallback_scale", self.scale,
              "2**-126 <= value <= 2**126")


def advance(cfg: FallbackConfig, *, finite: jax.Array, consecutive: jax.Array,
            active: jax.Array, steps_left: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One update of the fallback flag.

  The fallback starts on a skipped step that makes ``consecutive`` reach
  ``cfg.after`` while it is off, then lasts ``cfg.steps`` updates. Returns
  ``(active, steps_left, ended)``; ``ended`` is True on the update that turns
  it off, when the caller resets the loss scale.
  """
  ended = active & (steps_left <= 1)
  start = ~active & ~finite & (consecutive >= cfg.after)
  new_left = jnp.where(active, jnp.maximum(steps_left - 1, 0), jnp.where(start, cfg.steps, 0))
  return (active & ~ended) | start, new_left.astype(jnp.int32), ended


def fallback_active(opt_state: Any) -> jax.Array:
  """bool ``()``: whether the float32 fallback is on (the loss should run in float32).

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.
  """
  return find_state(opt_state).fp32_fallback


def _common_dtypes(fn_a: Callable, fn_b: Callable, args: tuple, kwargs: dict) -> Any:
  out_a = jax.eval_shape(lambda: fn_a(*args, **kwargs))
  out_b = jax.eval_shape(lambda: fn_b(*args, **kwargs))
  if jax.tree.structure(out_a) != jax.tree.structure(out_b):
    raise ValueError(
        "fp16_fn and fp32_fn must return the same pytree structure, got "
        f"{jax.tree.structure(out_a)} and {jax.tree.structure(out_b)}.")
  for a, b in zip(jax.tree.leaves(out_a), jax.tree.leaves(out_b)):
    if a.shape != b.shape:
      raise ValueError(f"fp16_fn and fp32_fn outputs differ in shape: {a.shape} vs {b.shape}.")
  return jax.tree.map(lambda a, b: jnp.promote_types(a.dtype, b.dtype), out_a, out_b)


def select_precision(opt_state: Any, fp16_fn: Callable, fp32_fn: Callable, *args: Any, **kwargs: Any) -> Any:
  """Calls ``fp32_fn(*args, **kwargs)`` while the fallback is on, else ``fp16_fn``.

  Both functions are traced once and chosen inside the compiled step with
  ``lax.cond`` on the state's ``fp32_fallback`` flag, so switching precision
  never recompiles. Outputs must have the same structure and shapes; each
  leaf is cast to the promoted dtype of the two (e.g. a float16 and a
  float32 loss both come back float32).

  Args:
    opt_state: an optimizer state holding one :class:`LossScaleState` built
      with ``fallback_after`` set (otherwise the flag is always False and
      ``fp16_fn`` always runs).
    fp16_fn: the computation in float16.
    fp32_fn: the same computation in float32.
    *args: passed to the chosen function (arrays, or pytrees).
    **kwargs: passed to the chosen function.

  Raises:
    TypeError: ``fp16_fn`` or ``fp32_fn`` is not callable.
    ValueError: the outputs differ in structure or shape, or ``opt_state``
      holds none or several loss-scale states.
  """
  v.function("fp16_fn", fp16_fn)
  v.function("fp32_fn", fp32_fn)
  flag = fallback_active(opt_state)
  dtypes = _common_dtypes(fp16_fn, fp32_fn, args, kwargs)

  def branch(fn):
    def run(operands):
      a, k = operands
      return jax.tree.map(lambda x, d: jnp.asarray(x).astype(d), fn(*a, **k), dtypes)
    return run

  return lax.cond(flag, branch(fp32_fn), branch(fp16_fn), (args, kwargs))


def fallback_value_and_grad(fp16_fn: Callable, fp32_fn: Callable, *, argnums: int | tuple[int, ...] = 0,
                            has_aux: bool = False) -> Callable:
  """``jax.value_and_grad`` of the fp16 or fp32 loss, chosen by the fallback flag.

  Returns ``f(opt_state, *args, **kwargs) -> (value, grads)`` (``((value,
  aux), grads)`` with ``has_aux``), which differentiates ``fp32_fn`` while
  the float32 fallback of ``opt_state`` is on and ``fp16_fn`` otherwise; see
  :func:`select_precision`. Both losses should already be multiplied by the
  loss scale (:func:`scale_loss`), as usual.

  Args:
    fp16_fn: the loss in float16 compute.
    fp32_fn: the loss in float32 compute, with ``fp16_fn``'s signature.
    argnums: int >= 0 or non-empty tuple of them, as in
      ``jax.value_and_grad``. Default 0.
    has_aux: bool, as in ``jax.value_and_grad``. Default False.

  Raises:
    TypeError: ``fp16_fn`` / ``fp32_fn`` not callable, ``argnums`` not an int
      or tuple of ints, ``has_aux`` not a bool.
    ValueError: a negative ``argnums``.
  """
  v.function("fp16_fn", fp16_fn)
  v.function("fp32_fn", fp32_fn)
  argnums = v.argnums(argnums)
  has_aux = v.boolean("has_aux", has_aux)
  vg16 = jax.value_and_grad(fp16_fn, argnums=argnums, has_aux=has_aux)
  vg32 = jax.value_and_grad(fp32_fn, argnums=argnums, has_aux=has_aux)

  def run(opt_state, *args, **kwargs):
    return select_precision(opt_state, vg16, vg32, *args, **kwargs)

  return run
