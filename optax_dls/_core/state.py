"""The loss-scale state: one NamedTuple of fixed-dtype arrays around the inner state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls._core import skip as _skip


class LossScaleState(NamedTuple):
  """State of a loss-scaled optimizer, kept inside the optax ``opt_state``.

  Every field but ``overflows``, ``policy_state`` and ``inner_state`` is a JAX array of
  the dtype below, so the state flattens, jits, scans, shards (replicated) and
  checkpoints like any optax state. It holds only what was learned, never how the
  transformation was built (policy, scale range, kind): a state restored into another
  transformation (dynamic, static, no-op, other settings) trains under that one's rule
  from its first update, which unscales by the restored scale the loss was multiplied
  by. With the dynamic policy and no ``labels``, it holds 8 arrays besides
  ``inner_state``.

  Attributes:
    loss_scale: float32 ``()``. The scale S to multiply the *next* loss by; each update
      leaves it within its policy's ``[min_scale, max_scale]`` (1 under a no-op policy).
    num_steps: int32 ``()``. ``update`` calls so far, skipped steps included.
      Saturates at ``2**31 - 1`` instead of wrapping.
    num_skipped: int32 ``()``. Skipped (non-finite) steps so far. Saturating.
    consecutive_skips: int32 ``()``. Skipped steps since the last applied one (0 after
      an applied step). Saturating.
    grad_norm: float32 ``()``. Global L2 norm of the last step's unscaled gradients (inf
      or NaN when they were not finite; NaN before the first step); under ``pmap`` /
      ``shard_map`` with ``axis_name``, the norm over every device.
    nonfinite: int32 ``[n + 2]``, the record of the last non-finite step: one code per
      floating gradient leaf (0 finite, 1 held an infinity, 2 held a NaN), then the
      loss's code (known when the loss is handed to ``update`` or ``value_and_grad``)
      and that step's number (0 before any). Read it with :func:`optax_dls.metrics`
      and :func:`optax_dls.nonfinite_leaves`.
    overflows: dict of int32 ``()`` per parameter-group label (``labels=``): the
      non-finite steps in which some leaf of that group was not finite; empty without
      labels. Saturating.
    policy_state: pytree of the loss-scale policy (the dynamic policy's
      ``growth_tracker`` and ``hysteresis_left``).
    inner_state: the wrapped optax transformation's state; bit-for-bit unchanged by a
      skipped step.
  """

  loss_scale: jax.Array
  num_steps: jax.Array
  num_skipped: jax.Array
  consecutive_skips: jax.Array
  grad_norm: jax.Array
  nonfinite: jax.Array
  overflows: dict[str, jax.Array]
  policy_state: Any
  inner_state: Any

  @property
  def last_step_finite(self) -> jax.Array:
    """bool ``()``: whether the last step was applied (True before the first step)."""
    return self.consecutive_skips == 0

  def __getattr__(self, name: str) -> Any:
    # Only for a name the state lacks: code that read the wrapped optimizer's state
    # directly (opt_state.gradient_step of a MultiStepsState) is told where it went.
    if name.startswith("__"):
      raise AttributeError(name)
    raise AttributeError(
      f"'LossScaleState' object has no attribute {name!r}: the wrapped optimizer's state "
      f"is its inner_state (optax_dls.find_state(opt_state).inner_state), or find a leaf "
      f"by name with optax.tree_utils.tree_get(opt_state, {name!r})."
    )


def init_state(
  loss_scale: Any, policy_state: Any, inner_state: Any, num_leaves: int, labels: Any = ()
) -> LossScaleState:
  """The state before the first step, every field its own buffer (donatable)."""
  zero = lambda: jnp.zeros([], jnp.int32)
  return LossScaleState(
    loss_scale=jnp.array(loss_scale, jnp.float32),
    num_steps=zero(),
    num_skipped=zero(),
    consecutive_skips=zero(),
    grad_norm=jnp.full([], jnp.nan, jnp.float32),
    nonfinite=jnp.zeros([num_leaves + 2], jnp.int32),
    overflows={label: zero() for label in sorted(set(labels))},
    policy_state=jax.tree.map(jnp.array, policy_state),
    inner_state=inner_state,
  )


# Updates traced at init to find the inner state's settled dtypes: optimizers that
# widen over several updates (optax.contrib.prodigy on float16 parameters) settle
# within two or three.
_SETTLE_TRIES = 4


def settled_inner_init(inner: optax.GradientTransformationExtraArgs, params: Any) -> Any:
  """``inner.init(params)`` in the types the inner updates give each leaf (the dtype they
  widen it to, strong where they return it strongly typed; traced with ``jax.eval_shape``
  until the types stop changing, the loss as a float32 ``value=`` where the update needs
  it), so the state's types are a fixed point from ``init``. Where the update cannot be
  traced without its other extra arguments (``optax.lbfgs``), the leaves are only made
  strongly typed."""
  state = jax.tree.map(_as_array, inner.init(params))
  for _ in range(_SETTLE_TRIES):
    try:
      after = _updated_state(inner, state, params)
    except Exception:  # noqa: BLE001 (an update that needs other extra arguments)
      return jax.tree.map(_skip.strong, state)
    if jax.tree.structure(after) != jax.tree.structure(state):  # type: ignore[operator]
      return jax.tree.map(_skip.strong, state)
    settled = jax.tree.map(_skip.like, state, after)
    if _types_of(settled) == _types_of(state):
      return settled
    state = settled
  return state


def _as_array(x: Any) -> Any:
  """A leaf of the inner ``init``'s state as ``jit`` returns it: a Python or NumPy
  scalar becomes an array (a Python one weakly typed, as ``jit`` gives it back)."""
  if isinstance(x, (bool, int, float, complex, np.generic)) and not isinstance(x, jax.Array):
    return jnp.asarray(x)
  return x


def _updated_state(inner: optax.GradientTransformationExtraArgs, state: Any, params: Any) -> Any:
  """The inner state's types after one update, traced: without extra arguments, or,
  where the update fails without one, with the loss as ``value``."""
  try:
    return jax.eval_shape(inner.update, params, state, params)[1]
  except Exception as without_value:  # noqa: BLE001 (TypeError or the optimizer's own error)
    value = jax.ShapeDtypeStruct((), jnp.float32)
    try:
      return jax.eval_shape(lambda s, p, v: inner.update(p, s, p, value=v), state, params, value)[1]
    except Exception:  # noqa: BLE001
      raise without_value from None


def _types_of(tree: Any) -> list[Any]:
  return [(getattr(x, "dtype", None), _skip.weak(x)) for x in jax.tree.leaves(tree)]
