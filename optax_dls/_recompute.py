"""Recomputing an overflowing step inside the same jitted step, so that no batch is lost.

Every other loss scaler throws an overflowing step away and backs the scale off
for the next batch. Here the whole step is one compiled program, so when the
gradients come back non-finite the same program backs off and computes them
again for the same batch, up to a bounded number of tries, then in float32 if
a float32 loss is given; only then is the step skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from optax_dls import _access, _validation


def value_and_grad(
  fun: Callable[..., Any],
  tx: Any,
  *,
  fp32_fun: Callable[..., Any] | None = None,
  max_tries: int = 3,
  argnums: int | tuple[int, ...] = 0,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of a loss-scaled loss that recomputes an overflowing step.

  The returned ``grad_fn(opt_state, *args, **kwargs)`` differentiates ``S *
  fun(*args, **kwargs)`` with S the loss scale in ``opt_state``. When the
  gradients are not finite, it hands them to the policy as an overflow (which
  backs S off, exactly as a skipped step would) and differentiates again at
  the new scale, for the same arguments, up to ``max_tries`` times; then once
  with ``fp32_fun`` at the last scale, if given. It returns the loss, the
  scaled gradients of the last try and ``opt_state`` with the scale they were
  computed at, so that ``tx.update`` unscales them correctly::

      grad_fn = optax_dls.value_and_grad(loss_fn, tx, fp32_fun=loss_fn_fp32)
      (loss, grads), opt_state = grad_fn(opt_state, params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)

  The first pass runs as the plain ``jax.grad`` would; the retries run in a
  ``lax.while_loop`` of the same compiled step, entered through a ``lax.cond``
  only after an overflow, which carries only the scale, the policy state and
  the last try's outputs. The common case (no overflow) is one forward and
  backward pass plus one read of the gradients, and the step compiles once
  (``fun`` is traced twice: for the first pass and for the loop). The
  policy sees every overflow:
  each failed try counts for growth and hysteresis as a skipped step would,
  and ``tx.update`` then sees the final gradients (finite, or, when every try
  overflowed, non-finite: the step is skipped as usual). ``metrics`` counts
  ``recomputed_steps`` and ``recompute_tries`` (the extra passes). The result
  equals a step run directly at the final scale, up to the rounding of the
  scaled loss and gradients (none when the scales are powers of two); a
  train step compiled with and without the retries may still differ in the
  last bit of a parameter, as XLA may contract the optimizer's arithmetic
  differently in the two programs.

  On the CPU every pass's gradients are pinned to the row-major layout, so
  that the retry branch's layouts do not make the common case transpose
  them. The pin is a ``LayoutConstraint`` custom call, which ``jax.export``
  refuses by default: export a step that calls ``grad_fn`` for the CPU with
  ``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("LayoutConstraint")]``.

  Under ``shard_map`` / ``pmap`` the check is reduced over the transformation's
  ``axis_name``, so every device takes the same number of tries. Under ``jit``
  with ``NamedSharding`` it is global. With ``optax.MultiSteps`` inside the
  transformation, each micro-batch is recomputed on its own.

  Args:
    fun: the loss function; returns the plain (unscaled) loss, a floating
      scalar (float16 is promoted to float32 before scaling), or ``(loss,
      aux)`` with ``has_aux=True``.
    tx: the loss-scaled transformation itself (what :func:`loss_scaled` or
      :func:`dynamic_loss_scale` return), not a chain around it.
    fp32_fun: optional, ``fun`` computed in float32: the last resort when
      every float16 try overflowed. Same signature and output structure and
      shapes; outputs of both are cast to their promoted dtypes.
    max_tries: int in [0, 64], recomputations in float16 after the first pass.
      Default 3.
    argnums: int or tuple of ints, as in ``jax.value_and_grad``. Default 0.
    has_aux: bool, as in ``jax.value_and_grad``. Default False.

  Returns:
    ``grad_fn(opt_state, *args, **kwargs) -> ((value, grads), opt_state)``,
    with ``value`` the loss (``(loss, aux)`` with ``has_aux``) and ``grads``
    scaled by ``opt_state``'s new loss scale.

  Raises:
    TypeError: ``fun`` / ``fp32_fun`` not callable, ``tx`` not a loss-scaled
      transformation, ``max_tries`` not an int, ``argnums`` / ``has_aux`` of
      the wrong type; (when called) a non-floating loss, fewer positional
      arguments than ``argnums`` asks for.
    ValueError: ``max_tries`` out of range, a negative or repeated ``argnums``; (when
      called) ``opt_state`` holding none or several loss-scale states, or
      outputs of ``fun`` and ``fp32_fun`` that differ in structure or shape.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**16)
    >>> params = {'w': jnp.ones(1)}
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p['w'].astype(jnp.float16) * 4.0)  # 4 * 2**16 overflows float16
    >>> (value, grads), state = optax_dls.value_and_grad(loss, tx)(state, params)
    >>> float(optax_dls.loss_scale(state)), int(optax_dls.metrics(state)['recompute_tries'])
    (8192.0, 3)
  """
  _validation.function("fun", fun)
  if fp32_fun is not None:
    _validation.function("fp32_fun", fp32_fun)
  back_off = getattr(tx, "back_off", None)
  if not callable(back_off):
    raise TypeError(
      f"tx must be the loss-scaled transformation itself (optax_dls.loss_scaled, "
      f"dynamic_loss_scale, ...), not a wrapper around it, got {tx!r}."
    )
  max_tries = _validation.count("max_tries", max_tries, low=0, high=64)
  argnums = _validation.argnums(argnums)
  has_aux = _validation.boolean("has_aux", has_aux)

  def grads_of(f):
    def scaled(scale, *args, **kwargs):
      out = f(*args, **kwargs)
      if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
          f"with has_aux=True, {getattr(f, '__qualname__', f)!r} must return a (loss, aux) pair."
        )
      loss = out[0] if has_aux else out
      return _access.times_scale(loss, scale), out

    nums = tuple(i + 1 for i in argnums) if isinstance(argnums, tuple) else argnums + 1
    return jax.grad(scaled, argnums=nums, has_aux=True)

  fp16_grads = grads_of(fun)
  fp32_grads = None if fp32_fun is None else grads_of(fp32_fun)

  def grad_fn(opt_state, *args, **kwargs):
    needed = max(argnums) if isinstance(argnums, tuple) else argnums
    if needed >= len(args):
      raise TypeError(
        f"argnums={argnums!r} asks for positional argument {needed} of fun, but "
        f"grad_fn(opt_state, *args) was called with {len(args)} positional arguments "
        f"after opt_state."
      )
    state = _access.find_state(opt_state)
    attempt = lambda grads, at: _row_major(_value_first(grads(at.loss_scale, *args, **kwargs)))
    types = _types(jax.eval_shape(lambda at: attempt(fp16_grads, at), state))
    if fp32_grads is not None:
      types = _types(jax.eval_shape(lambda at: attempt(fp32_grads, at), state), types)
    # The tries carry the scale and the policy state; the inner state stays out of the loop.
    light = state._replace(inner_state=())

    def try_at(at):  # one pass at ``at``; on an overflow, the state backed off from it
      out = _cast(attempt(fp16_grads, at), types)
      finite, backed_off = back_off(out[1], at)
      return finite, backed_off, out

    def cond(carry):
      tries, finite = carry[:2]
      return ~finite & (tries < max_tries)

    def body(carry):  # a try at the state the last one backed off to
      tries, _, _, at, _ = carry
      finite, backed_off, out = try_at(at)
      return tries + 1, finite, at, backed_off, out

    finite, backed_off, out = try_at(light)  # the common case: one pass, outside the loop
    tries, at = jnp.int32(0), light
    if (
      max_tries
    ):  # the loop only on an overflow: on XLA's CPU a while loop slows the step around it
      tries, finite, at, backed_off, out = lax.cond(
        finite,
        lambda c: c,
        lambda c: lax.while_loop(cond, body, c),
        (tries, finite, at, backed_off, out),
      )
    if fp32_grads is not None:  # the last resort, at the scale after the last overflow
      last = lambda: (_cast(attempt(fp32_grads, backed_off), types), backed_off, tries + 1)
      out, at, tries = lax.cond(finite, lambda: (out, at, tries), last)
    at = at._replace(
      recomputed_steps=_add(at.recomputed_steps, (tries > 0).astype(jnp.int32)),
      recompute_tries=_add(at.recompute_tries, tries),
      inner_state=state.inner_state,
    )
    return out, _access.replace_state(opt_state, at)

  return grad_fn


def _value_first(grads_and_out: tuple[Any, Any]) -> tuple[Any, Any]:
  grads, out = grads_and_out
  return out, grads


def _row_major(value_and_grads: tuple[Any, Any]) -> tuple[Any, Any]:
  """``(value, grads)`` with, on the CPU, every gradient of two or more dimensions
  pinned to the row-major layout, in every pass alike.

  Without the pin, XLA's CPU layout assignment gives the gradients leaving
  the retry branch the layouts of that branch's transposed products, and
  the branch that keeps the first pass's gradients then transposes them on
  every step, overflow or not. Row-major is the layout the optimizer reads
  and the parameters have, so the first pass costs nothing more. Other
  platforms choose their own layouts (tiled on TPUs) and are left alone."""
  value, grads = value_and_grads

  def pin(g):  # jax.grad's leaves are floating arrays (no float0 without allow_int)
    return with_layout_constraint(g, Layout(tuple(range(g.ndim)))) if g.ndim >= 2 else g

  return value, lax.platform_dependent(
    grads, cpu=lambda t: jax.tree.map(pin, t), default=lambda t: t
  )


def _types(out: Any, other: Any = None) -> Any:
  """``out``'s shapes and types, each dtype promoted with ``other``'s (same structure and shapes)."""
  if other is None:
    return out
  if jax.tree.structure(out) != jax.tree.structure(other):
    raise ValueError(
      "fun and fp32_fun must return the same pytree structure, got "
      f"{jax.tree.structure(other)} and {jax.tree.structure(out)}."
    )
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(other)):
    if a.shape != b.shape:
      raise ValueError(f"fun and fp32_fun outputs differ in shape: {b.shape} vs {a.shape}.")
  return jax.tree.map(lambda a, b: b.update(dtype=jnp.promote_types(a.dtype, b.dtype)), out, other)


def _cast(out: Any, types: Any) -> Any:
  return jax.tree.map(lambda x, t: jnp.asarray(x, t.dtype), out, types)


def _add(count: jax.Array, n: jax.Array) -> jax.Array:
  """``count + n`` for int32 ``n >= 0``, saturating at ``2**31 - 1``."""
  return jnp.where(count > _validation.INT32_MAX - n, _validation.INT32_MAX, count + n).astype(
    jnp.int32
  )
