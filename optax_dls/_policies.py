"""Loss-scale policies: the programmable rule that moves the loss scale.

A policy is a pair of pure functions over a small policy-state pytree, in the
style of an optax ``GradientTransformation``. The dynamic rule of
Micikevicius et al. (2018), *Mixed Precision Training*, Sec. 3.2, with the
hysteresis of Megatron-LM and DeepSpeed, is written once here
(:func:`dynamic_rule`) and reused by :func:`dynamic_policy`, the static and
no-op policies' state layout, and every preset of :mod:`optax_dls.compat`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls import _validation as v
from optax_dls._validation import SCALE_MAX, SCALE_MIN

STATS = frozenset({"amax"})


class GradStats(NamedTuple):
  """What a policy learns about one step's gradients.

  Attributes:
    finite: bool ``()``. True when the loss scale was valid and every
      floating entry of the unscaled gradients is finite (reduced over
      ``axis_name`` when one is given): the step was applied.
    step: int32 ``()``. Number of updates before this one, skipped included.
    grad_norm: float32 ``()``, global L2 norm of the *unscaled* gradients
      (inf or NaN on a non-finite step). With ``axis_name`` it is reduced
      over those axes, the same on every device.
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
  control flow on array values.

  :func:`optax_dls.loss_scaled` checks a policy when it is built: it calls
  ``init()`` once (tiny arrays, nothing compiled) and requires a
  float32-castable ``()`` loss scale in ``[min_scale, max_scale]``
  (ValueError) and a state that is a pytree of arrays (TypeError); at trace
  time ``update`` must return a ``(loss_scale, policy_state)`` pair with a
  floating ``()`` scale and a state of ``init``'s tree structure, shapes and
  dtypes (TypeError). Whatever ``update`` returns, the loss-scaled
  transformation keeps the scale within ``[min_scale, max_scale]``.

  Attributes:
    init: builds the initial ``(loss_scale, policy_state)``.
    update: moves the scale after one step, given that step's statistics.
    stats: optional statistics the policy needs beyond ``finite`` and
      ``grad_norm``: a tuple of strings drawn from ``("amax",)``. Default ``()``.
    passthrough: bool (a NumPy bool is accepted). When True the wrapper
      neither unscales nor checks nor skips: gradients go to the inner
      optimizer unchanged. Only sound when the scale is always 1 (the no-op
      policy), so ``init()`` must return a scale of exactly 1. Default False.
    min_scale: float in ``[2**-126, 2**126]``, the lowest scale the policy
      may take. Default ``2**-126``.
    max_scale: float in ``[min_scale, 2**126]``, the highest. Default ``2**126``.
  """

  init: Callable[[], tuple[jax.Array, Any]]
  update: Callable[[jax.Array, Any, GradStats], tuple[jax.Array, Any]]
  stats: tuple[str, ...] = ()
  passthrough: bool = False
  min_scale: float = SCALE_MIN
  max_scale: float = SCALE_MAX


class DynamicScaleState(NamedTuple):
  """Policy state of the dynamic rule (and, held constant, of the static and no-op policies).

  Attributes:
    growth_tracker: int32 ``()``. Consecutive finite steps since the last
      growth or overflow.
    hysteresis_left: int32 ``()``. Overflows still tolerated before a backoff.
  """

  growth_tracker: jax.Array
  hysteresis_left: jax.Array


def _dynamic_state(hysteresis: int) -> DynamicScaleState:
  return DynamicScaleState(jnp.zeros([], jnp.int32), jnp.asarray(hysteresis, jnp.int32))


def dynamic_rule(
  *,
  init_scale: float,
  min_scale: float,
  max_scale: float,
  growth_factor: float,
  growth_after: int,
  backoff_factor: float | None = None,
  backoff_divisor: float | None = None,
  reset_after_growth: int = 0,
  hysteresis: int = 1,
  consecutive_hysteresis: bool = False,
  warmup_steps: int = 0,
) -> LossScalePolicy:
  """The dynamic rule, with every variation of the established scalers as an option.

  Arguments are already checked. Finite step: ``tracker += 1``; with
  ``consecutive_hysteresis`` the hysteresis is refilled; when ``tracker >=
  growth_after`` and ``step >= warmup_steps``: ``S = min(S * growth_factor,
  max_scale)``, ``tracker = reset_after_growth``, hysteresis refilled.
  Non-finite step: ``tracker = 0``, the hysteresis drops by one (floored at
  0) and at 0 ``S = max(S * backoff_factor, min_scale)`` (or ``S /
  backoff_divisor``). Products and quotients are float32, each rounded once.
  """
  gf, lo, hi = jnp.float32(growth_factor), jnp.float32(min_scale), jnp.float32(max_scale)

  def init():
    return jnp.asarray(init_scale, jnp.float32), _dynamic_state(hysteresis)

  def update(scale, state, stats):
    finite = stats.finite
    tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
    grow = finite & (tracker >= growth_after) & (stats.step >= warmup_steps)
    left = jnp.maximum(state.hysteresis_left - 1, 0)
    backoff = ~finite & (left == 0)
    backed = (
      scale * jnp.float32(backoff_factor)
      if backoff_divisor is None
      else scale / jnp.float32(backoff_divisor)
    )
    new_scale = jnp.where(
      grow, jnp.minimum(scale * gf, hi), jnp.where(backoff, jnp.maximum(backed, lo), scale)
    )
    kept = jnp.asarray(hysteresis, jnp.int32) if consecutive_hysteresis else state.hysteresis_left
    new_state = DynamicScaleState(
      growth_tracker=jnp.where(grow, reset_after_growth, tracker).astype(jnp.int32),
      hysteresis_left=jnp.where(finite, jnp.where(grow, hysteresis, kept), left).astype(jnp.int32),
    )
    return new_scale.astype(jnp.float32), new_state

  return LossScalePolicy(init, update, min_scale=min_scale, max_scale=max_scale)


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
    max_scale: float in [min_scale, 2**126], ceiling of the scale (never
      inf). Default ``2**24``.
    hysteresis: int in [1, 2**31 - 1], overflows tolerated before a backoff
      (DeepSpeed ``delayed_shift``, Megatron ``hysteresis``). With 1 (the
      default) every overflow backs off, as in PyTorch.
    consecutive_hysteresis: bool. If True, every finite step refills the
      hysteresis (DeepSpeed's option); otherwise only a growth does (Megatron).
      Default False.
    warmup_steps: int in [0, 2**31 - 1]. No growth before this many updates.
      Default 0.

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
  growth_interval = v.count("growth_interval", growth_interval)
  init_scale, min_scale, max_scale = v.scale_range(
    ("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)
  )
  return dynamic_rule(
    init_scale=init_scale,
    min_scale=min_scale,
    max_scale=max_scale,
    growth_factor=growth_factor,
    growth_after=growth_interval,
    backoff_factor=backoff_factor,
    hysteresis=v.count("hysteresis", hysteresis),
    consecutive_hysteresis=v.boolean("consecutive_hysteresis", consecutive_hysteresis),
    warmup_steps=v.count("warmup_steps", warmup_steps, low=0),
  )


def static_policy(scale: float) -> LossScalePolicy:
  """A fixed loss scale: the scale never moves, non-finite steps are still skipped.

  Args:
    scale: float in [2**-126, 2**126], the constant loss scale S. It is also
      the policy's ``min_scale`` and ``max_scale``.

  Returns:
    A :class:`LossScalePolicy` with the same state layout as
    :func:`dynamic_policy` (a :class:`DynamicScaleState` held constant), so a
    checkpoint moves between the two.

  Raises:
    ValueError: ``scale`` out of range.
    TypeError: not a static number.
  """
  scale = v.scale("scale", scale)

  def init():
    return jnp.asarray(scale, jnp.float32), _dynamic_state(1)

  return LossScalePolicy(init, lambda s, state, stats: (s, state), min_scale=scale, max_scale=scale)


def noop_policy() -> LossScalePolicy:
  """No loss scaling, for bf16 or fp32 training: S = 1, nothing checked or skipped.

  Gradients reach the inner optimizer unchanged (``passthrough=True``), so the
  result is bit-for-bit the bare inner optimizer's. The state layout is the
  dynamic policy's, so the same training loop and checkpoints serve every
  precision.
  """
  return static_policy(1.0)._replace(passthrough=True)


class AmaxScaleState(NamedTuple):
  """Policy state of :func:`amax_policy`.

  Attributes:
    amax_history: float32 ``[history_len]``. The unscaled gradient statistic
      (amax or global norm) of the last ``history_len`` steps, newest first;
      0 marks an empty slot. A non-finite step at scale S records
      ``max_value / S``, the least magnitude that overflows at S.
    growth_tracker: int32 ``()``. Consecutive finite steps since the scale
      last moved.
  """

  amax_history: jax.Array
  growth_tracker: jax.Array


def _pow2_floor(x: jax.Array) -> jax.Array:
  """The largest power of two <= x, for normal positive float32 x."""
  _, exponent = jnp.frexp(x)
  return jnp.ldexp(jnp.ones([], jnp.float32), exponent - 1)


def amax_policy(
  init_scale: float = 2.0**15,
  margin: float = 2.0,
  history_len: int = 16,
  growth_interval: int = 16,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  min_scale: float = 1.0,
  max_scale: float = 2.0**24,
  max_value: float = 65504.0,
  statistic: str = "amax",
) -> LossScalePolicy:
  """Gradient-aware loss scaling: keep the scaled amax ``margin`` octaves below fp16 max.

  The dynamic rule learns the largest safe scale only by overflowing. This
  policy keeps a short history of the gradients' magnitude instead, the recipe
  of delayed scaling for FP8 (Micikevicius et al. 2022, *FP8 Formats for Deep
  Learning*; NVIDIA Transformer Engine ``DelayedScaling``). Each step records
  the unscaled gradient statistic ``a`` (the amax of the scaled gradients
  divided by S, or the global norm) and computes the target scale
  ``T = pow2_floor(max_value / 2**margin / max(history))``, clipped to
  ``[min_scale, max_scale]``: the largest power of two at which every recent
  scaled gradient stays below ``max_value / 2**margin``.

  * Finite step, ``T < S``: back off to ``T`` at once, before any overflow.
  * Finite step, ``T > S`` and ``growth_interval`` consecutive finite steps
    since the scale last moved: grow to ``min(S * growth_factor, T)``.
  * Non-finite step (skipped): ``S = max(S * backoff_factor, min_scale)`` as
    in the dynamic rule, and ``max_value / S`` enters the history (an
    overflow at S means the magnitude was at least that), which holds the
    scale down for the next ``history_len`` steps.

  The amax is taken over the gradients the optimizer receives: with float32
  master parameters cast to float16 inside the model, the float16 parameter
  gradients upcast. Activation cotangents inside the network are not seen;
  they can be larger, which is what ``margin`` absorbs. With
  ``statistic="grad_norm"`` the (larger) global norm stands in for the amax.

  Args:
    init_scale: float, the first scale, in ``[min_scale, max_scale]``.
      Default ``2**15``.
    margin: float in [0, 64], octaves of headroom below ``max_value``.
      Default 2.
    history_len: int in [1, 4096], steps in the history. Default 16.
    growth_interval: int in [1, 2**31 - 1], consecutive finite steps between
      two growths. Default 16.
    growth_factor: float > 1, the largest growth per step. Default 2.
    backoff_factor: float in (0, 1), backoff on a non-finite step. Default 0.5.
    min_scale: float in [2**-126, 2**126], floor of the scale. Default 1.
    max_scale: float in [min_scale, 2**126], ceiling of the scale. Default
      ``2**24``.
    max_value: float, the largest finite value of the compute dtype; it and
      ``max_value * 2**-margin`` must be normal finite float32 numbers.
      Default 65504 (float16).
    statistic: ``"amax"`` (default; asks the wrapper for the amax) or
      ``"grad_norm"``.

  Returns:
    A :class:`LossScalePolicy` whose state is an :class:`AmaxScaleState`.

  Raises:
    ValueError: a value outside its range; the message names it.
    TypeError: a wrong type, or a traced value where a static number is needed.
  """
  init_scale, min_scale, max_scale = v.scale_range(
    ("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)
  )
  margin = v.real("margin", margin)
  v.check(0.0 <= margin <= 64.0, "margin", margin, "0 <= value <= 64")
  history_len = v.count("history_len", history_len, high=4096)
  growth_interval = v.count("growth_interval", growth_interval)
  growth_factor = v.growth_factor("growth_factor", growth_factor)
  backoff_factor = v.backoff_factor("backoff_factor", backoff_factor)
  max_value = v.real("max_value", max_value)
  v.check(0.0 < max_value < math.inf, "max_value", max_value, "0 < value < inf")
  tiny = float(np.finfo(np.float32).tiny)
  for name, value in (
    ("max_value", max_value),
    ("max_value * 2**-margin", max_value * 2.0**-margin),
  ):
    v.float32(
      name, value, lambda r: tiny <= r < math.inf, "2**-126 <= value < inf (a normal number)"
    )
  if not isinstance(statistic, str) or statistic not in ("amax", "grad_norm"):
    kind = ValueError if isinstance(statistic, str) else TypeError
    raise kind(f"statistic must be 'amax' or 'grad_norm', got statistic={statistic!r}.")
  headroom = jnp.float32(max_value * 2.0**-margin)
  lo, hi = jnp.float32(min_scale), jnp.float32(max_scale)

  def init():
    return (
      jnp.asarray(init_scale, jnp.float32),
      AmaxScaleState(jnp.zeros([history_len], jnp.float32), jnp.zeros([], jnp.int32)),
    )

  def update(scale: jax.Array, state: AmaxScaleState, stats: GradStats) -> tuple[jax.Array, Any]:
    finite = stats.finite
    observed = stats.amax / scale if statistic == "amax" else stats.grad_norm
    observed = jnp.where(finite, observed, jnp.float32(max_value) / scale).astype(jnp.float32)
    history = jnp.roll(state.amax_history, 1).at[0].set(observed)
    peak = jnp.max(history)
    raw = jnp.where(peak > 0, headroom / jnp.maximum(peak, jnp.finfo(jnp.float32).tiny), hi)
    target = jnp.maximum(_pow2_floor(jnp.clip(raw, lo, hi)), lo)
    tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
    shrink = finite & (target < scale)
    grow = finite & (target > scale) & (tracker >= growth_interval)
    new_scale = jnp.where(
      shrink,
      target,
      jnp.where(
        grow,
        jnp.minimum(scale * jnp.float32(growth_factor), target),
        jnp.where(finite, scale, jnp.maximum(scale * jnp.float32(backoff_factor), lo)),
      ),
    )
    moved = shrink | grow
    return new_scale.astype(jnp.float32), AmaxScaleState(
      history, jnp.where(moved, 0, tracker).astype(jnp.int32)
    )

  return LossScalePolicy(
    init,
    update,
    stats=("amax",) if statistic == "amax" else (),
    min_scale=min_scale,
    max_scale=max_scale,
  )


# --- Checking a policy --------------------------------------------------------


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
  if (
    dtype is None
    or isinstance(scale, bool)
    or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
  ):
    raise ValueError(f"{what} must be a real number castable to float32, got {scale!r}.")
  if np.shape(scale) != ():
    raise ValueError(f"{what} must have shape (), got shape {np.shape(scale)} ({scale!r}).")
  if not isinstance(scale, jax.core.Tracer):
    with np.errstate(over="ignore"):
      value = float(np.float32(np.asarray(scale)))
    if not np.float32(policy.min_scale) <= value <= np.float32(policy.max_scale):
      raise ValueError(
        f"{what} must be finite and > 0, within the policy's [min_scale, max_scale] = "
        f"[{v.scale_text(policy.min_scale)}, {v.scale_text(policy.max_scale)}] in "
        f"float32, got {scale!r}."
      )
    if policy.passthrough and value != 1.0:
      raise ValueError(
        f"a policy with passthrough=True must start at loss scale 1 (gradients are not "
        f"unscaled), got {what} = {scale!r}."
      )
  leaves, treedef = jax.tree.flatten(state)
  for leaf in leaves:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
        f"the policy state returned by policy.init() ({policy.init!r}) must be a pytree of "
        f"arrays, got a leaf {leaf!r} of type {type(leaf).__name__}."
      )
  return treedef, [_leaf_spec(x) for x in leaves]


def _checked_update(policy: LossScalePolicy, treedef: Any, specs: list) -> Callable:
  """``policy.update`` with trace-time checks of its output (pure Python, no runtime cost)."""
  update = policy.update

  def checked(scale, state, stats):
    out = update(scale, state, stats)
    name = _name(policy)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        f"policy.update ({name}) must return a (loss_scale, policy_state) pair, got {out!r}."
      )
    new_scale, new_state = out
    if np.shape(new_scale) != () or not jnp.issubdtype(jnp.result_type(new_scale), jnp.floating):
      raise TypeError(
        f"policy.update ({name}) must return a floating loss scale of shape (), got "
        f"shape {np.shape(new_scale)} and dtype {jnp.result_type(new_scale)}."
      )
    leaves, new_def = jax.tree.flatten(new_state)
    if new_def != treedef:
      raise TypeError(
        f"policy.update ({name}) must return a policy state with the tree structure of "
        f"policy.init()'s, {treedef}, got {new_def}."
      )
    got = [_leaf_spec(x) for x in leaves]
    if got != specs:
      raise TypeError(
        f"policy.update ({name}) must return policy-state leaves with the shapes and dtypes of "
        f"policy.init()'s, {specs}, got {got}."
      )
    return new_scale, new_state

  return checked


def check_policy(policy: Any) -> LossScalePolicy:
  """Returns ``policy`` checked, its ``update`` wrapped with trace-time output checks.

  Runs ``policy.init()`` once, eagerly (tiny arrays; nothing is compiled).

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`; ``init`` / ``update`` not
      callable; ``stats`` not a tuple of strings; ``passthrough`` not a bool;
      ``min_scale`` / ``max_scale`` not numbers; ``init()`` not a
      ``(loss_scale, policy_state)`` pair or a state leaf that is not an array.
      At trace time: ``update`` returns something other than a
      ``(loss_scale, policy_state)`` pair with a floating ``()`` scale and a state
      of ``init``'s tree structure, shapes and dtypes.
    ValueError: unknown ``stats``; ``min_scale`` / ``max_scale`` outside
      ``[2**-126, 2**126]`` or in the wrong order; ``init``'s loss scale not a
      float32 ``()`` value in ``[min_scale, max_scale]``; ``passthrough=True``
      with an initial scale other than 1.
  """
  if not isinstance(policy, LossScalePolicy):
    raise TypeError(
      f"policy must be a LossScalePolicy, got {policy!r} of type {type(policy).__name__}."
    )
  if not (callable(policy.init) and callable(policy.update)):
    raise TypeError(f"policy.init and policy.update must be callable, got {policy!r}.")
  if not isinstance(policy.stats, (tuple, list)) or not all(
    isinstance(x, str) for x in policy.stats
  ):
    raise TypeError(
      f"policy.stats must be a tuple of strings drawn from {sorted(STATS)}, "
      f"got {policy.stats!r} of type {type(policy.stats).__name__}."
    )
  if set(policy.stats) - STATS:
    raise ValueError(
      f"policy.stats must be a tuple drawn from {sorted(STATS)}, got {policy.stats!r}."
    )
  lo = v.scale("policy.min_scale", policy.min_scale)
  hi = v.scale("policy.max_scale", policy.max_scale)
  v.check(lo <= hi, "policy.max_scale", hi, f"policy.max_scale >= policy.min_scale={lo!r}")
  policy = policy._replace(
    stats=tuple(policy.stats),
    min_scale=lo,
    max_scale=hi,
    passthrough=v.boolean("policy.passthrough", policy.passthrough),
  )
  treedef, specs = _check_init(policy)
  return policy._replace(update=_checked_update(policy, treedef, specs))
