"""Loss-scale policies: the programmable rule that moves the loss scale.

A policy is a pair of pure functions over a small policy-state pytree, in the
style of an optax ``GradientTransformation``. The built-in dynamic policy is
the rule of Micikevicius et al. (2018), *Mixed Precision Training*, Sec. 3.2,
with the hysteresis of Megatron-LM and DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls import _validation as v

# 1/S stays a normal float32 number over this range.
SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126
_STATS = frozenset({"grad_norm", "amax"})


class GradStats(NamedTuple):
  """What a policy learns about one step's gradients.

  Attributes:
    finite: bool ``()``. True when every floating entry of the unscaled
      gradients is finite (reduced over ``axis_name`` when one is given).
    step: int32 ``()``. Number of updates before this one, skipped included.
    grad_norm: float32 ``()``, global L2 norm of the *unscaled* gradients
      (inf or NaN on a non-finite step). Always present. With ``axis_name``
      it is reduced over those axes (sharded leaves summed, replicated ones
      counted once; see ``docs/multi_device.md``), the same on every device.
    amax: float32 ``()``, largest absolute value of the *scaled* gradients as
      they arrived (maximised over ``axis_name`` when one is given), or
      ``None`` unless the policy lists ``"amax"`` in ``LossScalePolicy.stats``.
  """

  finite: jax.Array
  step: jax.Array
  grad_norm: jax.Array
  amax: jax.Array | None = None


class LossScalePolicy(NamedTuple):
  """A loss-scale update rule as a pair of pure functions.

  Write one the way you write an optax transformation::

      def init() -> tuple[loss_scale, policy_state]
      def update(loss_scale, policy_state, stats) -> tuple[loss_scale, policy_state]

  ``loss_scale`` is a float32 ``()`` array; ``policy_state`` is any pytree of
  arrays with fixed dtypes (it lives in the optimizer state); ``stats`` is a
  :class:`GradStats`. Both functions are traced under ``jit``: no Python
  control flow on array values. The returned scale must be finite and > 0.

  :func:`loss_scaled` checks a policy when it is built: it calls ``init()``
  once (tiny arrays, nothing compiled) and requires a float32-castable ``()``
  loss scale that is finite and > 0 (ValueError) and a state that is a pytree
  of arrays (TypeError); at trace time ``update`` must return a
  ``(loss_scale, policy_state)`` pair with a floating ``()`` scale and a state
  of ``init``'s tree structure, shapes and dtypes (TypeError).

  Attributes:
    init: builds the initial ``(loss_scale, policy_state)``.
    update: moves the scale after one step, given that step's statistics.
    stats: optional statistics the policy needs beyond ``finite`` and
      ``grad_norm``: a tuple of strings drawn from ``("amax",)``. Default ``()``.
    passthrough: bool (a NumPy bool is accepted). When True the wrapper
      neither unscales nor checks nor skips: gradients go to the inner
      optimizer unchanged. Only sound when the scale is always 1 (the no-op
      policy), so ``init()`` must return a scale of exactly 1. Default False.
  """

  init: Callable[[], tuple[jax.Array, Any]]
  update: Callable[[jax.Array, Any, GradStats], tuple[jax.Array, Any]]
  stats: tuple[str, ...] = ()
  passthrough: bool = False


class DynamicScaleState(NamedTuple):
  """Policy state of the dynamic (and, held constant, static and no-op) policy.

  Attributes:
    growth_tracker: int32 ``()``. Consecutive finite steps since the last
      growth or overflow.
    hysteresis_left: int32 ``()``. Overflows still tolerated before a backoff.
  """

  growth_tracker: jax.Array
  hysteresis_left: jax.Array


def _policy_state(hysteresis: int) -> DynamicScaleState:
  return DynamicScaleState(jnp.zeros([], jnp.int32), jnp.asarray(hysteresis, jnp.int32))


def _scale_value(name: str, value: Any) -> float:
  value = v.real(name, value)
  v.check(SCALE_MIN <= value <= SCALE_MAX, name, value, "2**-126 <= value <= 2**126")
  return value


def dynamic_policy(
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    warmup_steps: int = 0,
) -> LossScalePolicy:
  """Dynamic loss scaling (Micikevicius et al. 2018, Mixed Precision Training).

  On a finite step the growth tracker counts up; on the ``growth_interval``-th
  consecutive finite step (and once ``warmup_steps`` updates have run) the
  scale is multiplied by ``growth_factor``, capped at ``max_scale``, the
  tracker resets and the hysteresis is refilled. On a non-finite step the
  tracker resets and the hysteresis drops by one (floored at 0); when it is 0
  the scale is multiplied by ``backoff_factor``, floored at ``min_scale``.
  The growth timing matches PyTorch ``GradScaler``, jmp and Keras; flax's
  ``DynamicScale`` grows one step later.

  Args:
    init_scale: float, initial loss scale S. Default ``2**15``. Must satisfy
      ``min_scale <= init_scale <= max_scale``.
    growth_factor: float > 1, finite, also once rounded to float32 (so not
      within ~6e-8 of 1). Default 2.
    backoff_factor: float in (0, 1), also once rounded to float32 (so not
      within ~3e-8 of 1, nor below ~1e-45). Default 0.5.
    growth_interval: int in [1, 2**31 - 1], consecutive finite steps before a
      growth. Default 2000.
    min_scale: float in [2**-126, 2**126], floor of the scale. Default 1.
    max_scale: float in [2**-126, 2**126], ceiling of the scale (never inf).
      Default ``2**24``.
    hysteresis: int in [1, 2**31 - 1], overflows tolerated before a backoff
      (DeepSpeed ``delayed_shift``, Megatron ``hysteresis``). With 1 (the
      default) every overflow backs off, as in PyTorch.
    consecutive_hysteresis: bool. If True, every finite step refills the
      hysteresis (DeepSpeed's option); otherwise only a growth does (Megatron).
      Default False.
    warmup_steps: int >= 0. No growth before this many updates. Default 0.

  Returns:
    A :class:`LossScalePolicy` whose state is a :class:`DynamicScaleState`.

  Raises:
    ValueError: a value outside its valid range; the message names it.
    TypeError: a value of the wrong type, or a traced (non-static) value.

  Example:
    >>> import jax.numpy as jnp, optax_dls
    >>> policy = optax_dls.dynamic_policy(init_scale=8.0, growth_interval=2)
    >>> scale, state = policy.init()
    >>> for finite in [True, True, False]:
    ...   stats = optax_dls.GradStats(finite=jnp.array(finite), step=jnp.array(0),
    ...                               grad_norm=jnp.array(1.0))
    ...   scale, state = policy.update(scale, state, stats)
    ...   print(float(scale))
    8.0
    16.0
    8.0
  """
  growth_factor = v.growth_factor("growth_factor", growth_factor)
  backoff_factor = v.backoff_factor("backoff_factor", backoff_factor)
  growth_interval = v.integer("growth_interval", growth_interval)
  v.check(1 <= growth_interval <= v.INT32_MAX, "growth_interval", growth_interval, "1 <= value <= 2**31 - 1")
  min_scale = _scale_value("min_scale", min_scale)
  max_scale = _scale_value("max_scale", max_scale)
  v.check(min_scale <= max_scale, "max_scale", max_scale, f"max_scale >= min_scale={min_scale!r}")
  init_scale = _scale_value("init_scale", init_scale)
  v.check(min_scale <= init_scale <= max_scale, "init_scale", init_scale,
          f"min_scale={min_scale!r} <= init_scale <= max_scale={max_scale!r}")
  hysteresis = v.integer("hysteresis", hysteresis)
  v.check(1 <= hysteresis <= v.INT32_MAX, "hysteresis", hysteresis, "1 <= value <= 2**31 - 1")
  consecutive_hysteresis = v.boolean("consecutive_hysteresis", consecutive_hysteresis)
  warmup_steps = v.integer("warmup_steps", warmup_steps)
  v.check(0 <= warmup_steps <= v.INT32_MAX, "warmup_steps", warmup_steps, "0 <= value <= 2**31 - 1")

  def init():
    return jnp.asarray(init_scale, jnp.float32), _policy_state(hysteresis)

  def update(scale, state, stats):
    finite = stats.finite
    tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
    grow = finite & (tracker >= growth_interval) & (stats.step >= warmup_steps)
    left = jnp.maximum(state.hysteresis_left - 1, 0)
    backoff = ~finite & (left == 0)
    kept = jnp.asarray(hysteresis, jnp.int32) if consecutive_hysteresis else state.hysteresis_left
    new_scale = jnp.where(
        grow, jnp.minimum(scale * growth_factor, max_scale),
        jnp.where(backoff, jnp.maximum(scale * backoff_factor, min_scale), scale))
    new_state = DynamicScaleState(
        growth_tracker=jnp.where(grow, 0, tracker).astype(jnp.int32),
        hysteresis_left=jnp.where(finite, jnp.where(grow, hysteresis, kept), left).astype(jnp.int32))
    return new_scale.astype(jnp.float32), new_state

  return LossScalePolicy(init, update)


def static_policy(scale: float) -> LossScalePolicy:
  """A fixed loss scale: the scale never moves, non-finite steps are still skipped.

  Args:
    scale: float in [2**-126, 2**126], the constant loss scale S.

  Returns:
    A :class:`LossScalePolicy` with the same state layout as
    :func:`dynamic_policy` (a :class:`DynamicScaleState` held constant), so a
    checkpoint moves between the two.

  Raises:
    ValueError: ``scale`` out of range.
    TypeError: not a static number.
  """
  scale = _scale_value("scale", scale)

  def init():
    return jnp.asarray(scale, jnp.float32), _policy_state(1)

  return LossScalePolicy(init, lambda s, state, stats: (s, state))


def noop_policy() -> LossScalePolicy:
  """No loss scaling, for bf16 or fp32 training: S = 1, nothing checked or skipped.

  Gradients reach the inner optimizer unchanged, so the result is bit-for-bit
  the bare inner optimizer's. The state layout is the dynamic policy's, so the
  same training loop and checkpoints serve every precision.
  """

  def init():
    return jnp.ones([], jnp.float32), _policy_state(1)

  return LossScalePolicy(init, lambda s, state, stats: (s, state), passthrough=True)


def _name(policy: LossScalePolicy) -> str:
  return getattr(policy.update, "__qualname__", None) or repr(policy.update)


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], Any]:
  return tuple(np.shape(x)), jnp.result_type(x)


def _check_init(policy: LossScalePolicy) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
  """Runs ``policy.init()`` once (tiny arrays, no compilation) and checks what it returns.

  Returns the tree structure and the (shape, dtype) of each leaf of the policy state.
  """
  out = policy.init()
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(f"policy.init() must return a (loss_scale, policy_state) pair, got {out!r}.")
  scale, state = out
  what = f"the loss scale returned by policy.init() ({policy.init!r})"
  try:
    dtype = jnp.result_type(scale)
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or isinstance(scale, bool) or not (
      jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"{what} must be a real number castable to float32, got {scale!r}.")
  if np.shape(scale) != ():
    raise ValueError(f"{what} must have shape (), got shape {np.shape(scale)} ({scale!r}).")
  if not isinstance(scale, jax.core.Tracer):
    with np.errstate(over="ignore"):
      value = float(np.float32(np.asarray(scale)))
    if not 0.0 < value < float("inf"):
      raise ValueError(f"{what} must be finite and > 0 in float32, got {scale!r}.")
    if policy.passthrough and value != 1.0:
      raise ValueError(
          f"a policy with passthrough=True must start at loss scale 1 (gradients are not "
          f"unscaled), got {what} = {scale!r}.")
  leaves, treedef = jax.tree.flatten(state)
  for leaf in leaves:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
          f"the policy state returned by policy.init() ({policy.init!r}) must be a pytree of "
          f"arrays, got a leaf {leaf!r} of type {type(leaf).__name__}.")
  return treedef, [_leaf_spec(x) for x in leaves]


def _checked_update(policy: LossScalePolicy, treedef: Any, specs: list) -> Callable:
  """``policy.update`` with trace-time checks of its output (pure Python, no runtime cost)."""
  update = policy.update

  def checked(scale, state, stats):
    out = update(scale, state, stats)
    name = _name(policy)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(f"policy.update ({name}) must return a (loss_scale, policy_state) pair, got {out!r}.")
    new_scale, new_state = out
    if np.shape(new_scale) != () or not jnp.issubdtype(jnp.result_type(new_scale), jnp.floating):
      raise TypeError(
          f"policy.update ({name}) must return a floating loss scale of shape (), got "
          f"shape {np.shape(new_scale)} and dtype {jnp.result_type(new_scale)}.")
    leaves, new_def = jax.tree.flatten(new_state)
    if new_def != treedef:
      raise TypeError(
          f"policy.update ({name}) must return a policy state with the tree structure of "
          f"policy.init()'s, {treedef}, got {new_def}.")
    got = [_leaf_spec(x) for x in leaves]
    if got != specs:
      raise TypeError(
          f"policy.update ({name}) must return policy-state leaves with the shapes and dtypes of "
          f"policy.init()'s, {specs}, got {got}.")
    return new_scale, new_state

  return checked


def check_policy(policy: Any) -> LossScalePolicy:
  """Returns ``policy`` checked, its ``update`` wrapped with trace-time output checks.

  Runs ``policy.init()`` once, eagerly (tiny arrays; nothing is compiled).

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`; ``init`` / ``update`` not
      callable; ``stats`` not a tuple of strings; ``passthrough`` not a bool;
      ``init()`` not a ``(loss_scale, policy_state)`` pair or a state leaf that is not
      an array. At trace time: ``update`` returns something other than a
      ``(loss_scale, policy_state)`` pair with a floating ``()`` scale and a state
      of ``init``'s tree structure, shapes and dtypes.
    ValueError: unknown ``stats``; ``init``'s loss scale not a finite float32 ``()``
      value > 0; ``passthrough=True`` with an initial scale other than 1.
  """
  if not isinstance(policy, LossScalePolicy):
    raise TypeError(f"policy must be a LossScalePolicy, got {policy!r} of type {type(policy).__name__}.")
  if not (callable(policy.init) and callable(policy.update)):
    raise TypeError(f"policy.init and policy.update must be callable, got {policy!r}.")
  if not isinstance(policy.stats, (tuple, list)) or not all(isinstance(x, str) for x in policy.stats):
    raise TypeError(f"policy.stats must be a tuple of strings drawn from {sorted(_STATS)}, "
                    f"got {policy.stats!r} of type {type(policy.stats).__name__}.")
  unknown = set(policy.stats) - _STATS
  if unknown:
    raise ValueError(f"policy.stats must be a tuple drawn from {sorted(_STATS)}, got {policy.stats!r}.")
  policy = policy._replace(stats=tuple(policy.stats),
                           passthrough=v.boolean("policy.passthrough", policy.passthrough))
  treedef, specs = _check_init(policy)
  return policy._replace(update=_checked_update(policy, treedef, specs))
