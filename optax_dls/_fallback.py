"""Float32 fallback: run the loss in float32 for a while after a run of skipped steps.

A policy wrapper owns the flag and the scale: after ``after`` consecutive
skips it turns the flag on for ``steps`` updates, then restarts the wrapped
policy at ``scale``. :func:`select_precision` reads the flag inside the
jitted step to pick the float16 or the float32 computation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_dls import _access, _policies
from optax_dls import _validation as v


class FallbackState(NamedTuple):
  """Policy state of :func:`fp32_fallback`.

  Attributes:
    policy_state: the wrapped policy's state.
    fp32_fallback: bool ``()``. True while the loss should run in float32.
    steps_left: int32 ``()``. Updates left before the fallback ends (0 when off).
    consecutive_skips: int32 ``()``. Skipped steps since the last applied one.
  """

  policy_state: Any
  fp32_fallback: jax.Array
  steps_left: jax.Array
  consecutive_skips: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    return {"fp32_fallback": self.fp32_fallback}


def fp32_fallback(
  policy: _policies.LossScalePolicy,
  *,
  after: int = 10,
  steps: int = 100,
  scale: float | None = None,
) -> _policies.LossScalePolicy:
  """Wraps ``policy`` with a float32 fallback for when float16 keeps failing.

  When a skipped step makes ``after`` consecutive skips, the state's
  ``fp32_fallback`` flag turns on for the next ``steps`` updates, during which
  :func:`select_precision` computes the
  loss in float32; the wrapped policy keeps moving the scale meanwhile. On
  the update that ends it, the scale restarts at ``scale`` and the wrapped
  policy's state at its initial value. :func:`metrics` reports the flag as
  ``fp32_fallback``.

  Args:
    policy: the :class:`LossScalePolicy` to wrap, e.g. :func:`dynamic_policy`.
    after: int in [1, 2**31 - 1], consecutive skipped steps that start the
      fallback. Default 10.
    steps: int in [1, 2**31 - 1], updates the fallback lasts. Default 100.
    scale: float in the policy's ``[min_scale, max_scale]``, or None (the
      default: the policy's initial scale), the scale to restart at.

  Returns:
    A :class:`LossScalePolicy` whose state is a :class:`FallbackState`.

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`, or a wrong or
      traced value.
    ValueError: a value out of range, ``scale`` included (the message names it).

  Example:
    >>> import optax, optax_dls
    >>> policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=10, steps=100)
    >>> tx = optax_dls.loss_scaled(optax.adam(1e-3), policy)
  """
  policy = _policies.check_policy(policy)
  after = v.count("after", after)
  steps = v.count("steps", steps)
  if scale is not None:
    scale = v.scale("scale", scale, policy.min_scale, policy.max_scale)

  def init():
    init_scale, policy_state = policy.init()
    off = jnp.zeros([], jnp.int32)
    return init_scale, FallbackState(policy_state, jnp.zeros([], jnp.bool_), off, off)

  def update(loss_scale, state, stats):
    new_scale, policy_state = policy.update(loss_scale, state.policy_state, stats)
    consecutive = jnp.where(stats.finite, 0, optax.safe_increment(state.consecutive_skips))
    active = state.fp32_fallback
    ended = active & (state.steps_left <= 1)
    start = ~active & ~stats.finite & (consecutive >= after)
    left = jnp.where(active, jnp.maximum(state.steps_left - 1, 0), jnp.where(start, steps, 0))
    restart_scale, restart_state = policy.init()
    restart_scale = restart_scale if scale is None else scale
    new_scale = jnp.where(ended, restart_scale, new_scale).astype(jnp.float32)
    policy_state = jax.tree.map(
      lambda a, b: jnp.where(ended, a, b).astype(jnp.result_type(b)), restart_state, policy_state
    )
    return new_scale, FallbackState(
      policy_state, (active & ~ended) | start, left.astype(jnp.int32), consecutive.astype(jnp.int32)
    )

  return policy._replace(init=init, update=update)


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
  v.function("fp16_fn", fp16_fn)
  v.function("fp32_fn", fp32_fn)
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
