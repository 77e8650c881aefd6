"""Finding the loss-scale state anywhere inside an optimizer state, and reading it."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_dls import _validation as v
from optax_dls._policy import SCALE_MAX, SCALE_MIN
from optax_dls._monitoring import flatten_underflow
from optax_dls._state import LossScaleState


def _is_ours(x: Any) -> bool:
  return isinstance(x, LossScaleState)


_MULTISTEPS_OUTSIDE = (
    "opt_state is an optax.MultiSteps state wrapping a loss-scaled optimizer, "
    "MultiSteps(dynamic_loss_scale(...)). This order is not supported: MultiSteps adds every "
    "micro-batch to its accumulator before the loss scaler can check it, so one non-finite "
    "micro-batch poisons the accumulator for good (0 * NaN = NaN). Put the loss scaling "
    "outside: optax_dls.dynamic_loss_scale(optax.MultiSteps(inner, every_k_schedule=k)); "
    "a non-finite micro-batch is then dropped and the loss scale backs off.")


def _is_node(x: Any) -> bool:
  return _is_ours(x) or isinstance(x, optax.MultiStepsState)


def _find_all(tree: Any) -> list[LossScaleState]:
  found = []
  for leaf in jax.tree.leaves(tree, is_leaf=_is_node):
    if isinstance(leaf, optax.MultiStepsState):
      if _find_all(leaf.inner_opt_state):
        raise ValueError(_MULTISTEPS_OUTSIDE)
    elif _is_ours(leaf):
      found.append(leaf)
      found.extend(_find_all((leaf.policy_state, leaf.inner_state)))
  return found


def _unwrap(tree: Any) -> Any:
  """Replaces flax ``nnx.Variable`` leaves (an ``nnx.Optimizer``'s state) by their arrays.

  flax is never imported here: without it loaded there can be no Variables.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  is_var = lambda x: isinstance(x, nnx.Variable)
  value = lambda x: x.get_value() if hasattr(x, "get_value") else x.value
  return jax.tree.map(lambda x: value(x) if is_var(x) else x, tree, is_leaf=is_var)


def _like(old: Any, new: jax.Array) -> Any:
  """``new`` in ``old``'s place: same dtype, and same wrapper (e.g. an nnx Variable) if any."""
  dtype = jnp.result_type(jax.tree.leaves(old)[0])
  return jax.tree.unflatten(jax.tree.structure(old), [jnp.asarray(new, dtype)])


def find_state(opt_state: Any) -> LossScaleState:
  """Returns the one :class:`LossScaleState` inside ``opt_state``.

  ``opt_state`` may be the state itself or any pytree holding it: an
  ``optax.chain`` state, a loss-scaled ``optax.MultiSteps`` state, a dict, a
  flax ``TrainState``, an ``nnx.Optimizer`` or its ``opt_state``. Leaves
  wrapped in ``nnx.Variable`` are returned as plain arrays.

  Raises:
    ValueError: there is no loss-scale state in ``opt_state``, or more than
      one, or it sits inside ``optax.MultiSteps`` (unsupported order; the
      message says what to do instead).
  """
  found = _find_all(opt_state)
  if not found:
    raise ValueError(
        "opt_state holds no LossScaleState: pass the state of an optimizer built with "
        "optax_dls.dynamic_loss_scale / static_loss_scale / no_loss_scale / loss_scaled, "
        f"got a {type(opt_state).__name__}.")
  if len(found) > 1:
    raise ValueError(
        f"opt_state holds {len(found)} LossScaleStates, so which scale to use is ambiguous: "
        "wrap the optimizer once, at the outside, or pass the sub-state you mean.")
  return _unwrap(found[0])


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale S: a float32 ``()`` array (stays on the device).

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.
  """
  return find_state(opt_state).loss_scale


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """Multiplies ``loss`` by the current loss scale S, before differentiation.

  Micikevicius et al. (2018), *Mixed Precision Training*: scaling the loss
  scales every gradient by S, lifting small fp16 gradients out of the
  underflow range. The optimizer built by :func:`dynamic_loss_scale` divides
  them by the same S.

  Args:
    loss: a floating array of any shape (usually the scalar loss, float32).
      bfloat16 and float16 losses are promoted to float32 so that the scaled
      value cannot overflow their range.
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Returns:
    ``loss * S`` with dtype ``promote_types(loss.dtype, float32)``.

  Raises:
    TypeError: ``loss`` is not a floating-point array (e.g. an int, a str or None).
    ValueError: none or more than one loss-scale state in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> optax_dls.scale_loss(jnp.float16(0.5), state)
    Array(512., dtype=float32)
  """
  scale = loss_scale(opt_state)
  if loss is None or isinstance(loss, (str, bytes)):
    raise TypeError(f"loss must be a floating-point array, got {loss!r} of type {type(loss).__name__}.")
  try:
    loss = jnp.asarray(loss)
  except (TypeError, ValueError) as e:
    raise TypeError(f"loss must be a floating-point array, got {loss!r} of type "
                    f"{type(loss).__name__}: {e}") from None
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss must be a floating-point array, got dtype {loss.dtype}.")
  dtype = jnp.promote_types(loss.dtype, jnp.float32)
  return loss.astype(dtype) * scale.astype(dtype)


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """What the loss scaler did, as a dict of 0-d arrays (no host transfer).

  Keys:
    ``loss_scale`` (float32): the scale for the next loss.
    ``skipped`` (bool): whether the last step was skipped.
    ``skip_count`` (int32): skipped steps so far.
    ``consecutive_skips`` (int32): skipped steps since the last applied one.
    ``num_steps`` (int32): updates so far, skipped included.
    ``update_ratio`` (float32): applied steps over all steps (1 before any).
    ``grad_norm`` (float32): global L2 norm of the last step's unscaled
      gradients (NaN before the first step).
    ``fp32_fallback`` (bool): whether the float32 fallback is on (always
      False unless the transformation was built with ``fallback_after``).
    ``underflow/zero_frac``, ``underflow/subnormal_frac`` (float32), and
      ``underflow/<label>/zero_frac``, ``underflow/<label>/subnormal_frac``
      per parameter label: only when built with ``underflow_stats``; the
      fractions of zero and of fp16-subnormal (0 < |x| < 2**-14) entries of
      the last step's unscaled gradients (NaN before the first step).

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.array([1.0, jnp.inf])}, state, params)
    >>> m = optax_dls.metrics(state)
    >>> float(m['loss_scale']), bool(m['skipped']), int(m['skip_count'])
    (512.0, True, 1)
  """
  s = find_state(opt_state)
  steps = s.num_steps.astype(jnp.float32)
  applied = steps - s.num_skipped.astype(jnp.float32)
  return {
      "loss_scale": s.loss_scale,
      "skipped": ~s.last_step_finite,
      "skip_count": s.num_skipped,
      "consecutive_skips": s.consecutive_skips,
      "num_steps": s.num_steps,
      "update_ratio": jnp.where(steps > 0, applied / jnp.maximum(steps, 1.0), 1.0),
      "grad_norm": s.grad_norm,
      "fp32_fallback": s.fp32_fallback,
      **flatten_underflow(s.underflow),
  }


def applied_steps(opt_state: Any) -> jax.Array:
  """Number of applied (not skipped) updates: ``num_steps - skip_count``, int32 ``()``.

  Step counters kept outside the optimizer state, such as flax
  ``TrainState.step`` and ``nnx.Optimizer.step``, count skipped steps too;
  this is the count of updates that reached the inner optimizer. When the
  loss scaling wraps ``optax.MultiSteps``, it counts applied micro-batches;
  the applied windows are the ``MultiStepsState.gradient_step``.

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.
  """
  s = find_state(opt_state)
  return s.num_steps - s.num_skipped


def reset_scale(opt_state: Any, value: float) -> Any:
  """Returns ``opt_state`` with the loss scale set to ``value``.

  The growth tracker of the built-in policies restarts at 0; every other
  field, the inner state included, is kept.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.
    value: the new loss scale, a number or float32 ``()`` array in
      [2**-126, 2**126]. A traced array is allowed (shape ``()`` required;
      no range check then).

  Raises:
    ValueError: ``value`` out of range, a traced ``value`` not of shape ``()``,
      or none or more than one loss-scale state in ``opt_state``.
    TypeError: ``value`` not a real number.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({'w': jnp.ones(2)})
    >>> optax_dls.loss_scale(optax_dls.reset_scale(state, 2.0**12))
    Array(4096., dtype=float32)
  """
  find_state(opt_state)
  if isinstance(value, jax.core.Tracer) and value.shape != ():
    raise ValueError(f"value must be a scalar of shape (), got a traced value {value!r} "
                     f"of shape {value.shape}.")
  if not isinstance(value, jax.core.Tracer):
    value = v.real("value", value)
    v.check(SCALE_MIN <= value <= SCALE_MAX, "value", value, "2**-126 <= value <= 2**126")

  def reset(x):
    if not _is_ours(x):
      return x
    ps = x.policy_state
    if hasattr(ps, "growth_tracker") and hasattr(ps, "_replace"):
      ps = ps._replace(growth_tracker=_like(ps.growth_tracker, 0))
    return x._replace(loss_scale=_like(x.loss_scale, value), policy_state=ps)

  return jax.tree.map(reset, opt_state, is_leaf=_is_ours)
