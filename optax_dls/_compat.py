"""Loss-scale policies that reproduce the scale trajectories of other frameworks.

Each preset returns a :class:`LossScalePolicy` whose scale, given the same
sequence of finite / non-finite steps, equals the reference implementation's
scale bit for bit, as long as the reference stays inside ``[2**-126, 2**126]``
(the range of every optax_dls scale, where ``1/S`` is a normal float32
number). Where each reference leaves that range, and the other conditions for
exactness, are listed per preset and in ``docs/policies.md``.

References (read from the installed sources):
  PyTorch ``torch/amp/grad_scaler.py`` and ``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``;
  Megatron-LM ``megatron/core/optimizer/grad_scaler.py``;
  DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``;
  Keras 3 ``keras/src/optimizers/loss_scale_optimizer.py``;
  jmp ``jmp/_src/loss_scale.py``; flax ``flax/training/dynamic_scale.py``.
The rule itself is dynamic loss scaling, Micikevicius et al. (2018), *Mixed
Precision Training*, Sec. 3.2.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from optax_dls import _validation as v
from optax_dls._policy import SCALE_MAX, SCALE_MIN, DynamicScaleState, LossScalePolicy


def _scale(name: str, value: Any) -> float:
  value = v.real(name, value)
  v.check(SCALE_MIN <= value <= SCALE_MAX, name, value, "2**-126 <= value <= 2**126")
  return value


_growth = v.growth_factor
_backoff = v.backoff_factor


def _count(name: str, value: Any, low: int = 1) -> int:
  value = v.integer(name, value)
  v.check(low <= value <= v.INT32_MAX - 1, name, value, f"{low} <= value <= 2**31 - 2")
  return value


_flag = v.boolean


def _rule(*, init_scale: float, growth_factor: float, growth_after: int,
          backoff_factor: float | None = None, backoff_divisor: float | None = None,
          reset_after_growth: int = 0, min_scale: float = SCALE_MIN,
          hysteresis: int = 1, consecutive_hysteresis: bool = False,
          names: tuple[str, str] = ("init_scale", "min_scale")) -> LossScalePolicy:
  """The common shape of every reference rule, with its variations as options.

  Finite step: ``tracker += 1``; growth when ``tracker >= growth_after``, then
  ``S = min(S * growth_factor, 2**126)``, ``tracker = reset_after_growth`` and
  the hysteresis is refilled (every finite step refills it when
  ``consecutive_hysteresis``). Non-finite step: ``tracker = 0``, the
  hysteresis drops by one (floored at 0) and at 0 ``S = max(S * backoff_factor,
  min_scale)`` (or ``S / backoff_divisor``). Products and quotients are float32,
  each rounded once, as in the references.
  """
  if min_scale > init_scale:
    raise ValueError(f"{names[0]} must satisfy {names[0]} >= {names[1]}={min_scale!r}, "
                     f"got {names[0]}={init_scale!r}.")
  gf = jnp.float32(growth_factor)
  lo = jnp.float32(min_scale)

  def init():
    return (jnp.asarray(init_scale, jnp.float32),
            DynamicScaleState(jnp.zeros([], jnp.int32), jnp.asarray(hysteresis, jnp.int32)))

  def update(scale, state, stats):
    finite = stats.finite
    tracker = jnp.where(finite, optax.safe_increment(state.growth_tracker), 0)
    grow = finite & (tracker >= growth_after)
    left = jnp.maximum(state.hysteresis_left - 1, 0)
    backoff = ~finite & (left == 0)
    if backoff_divisor is None:
      backed = scale * jnp.float32(backoff_factor)
    else:
      backed = scale / jnp.float32(backoff_divisor)
    new_scale = jnp.where(grow, jnp.minimum(scale * gf, jnp.float32(SCALE_MAX)),
                          jnp.where(backoff, jnp.maximum(backed, lo), scale))
    kept = jnp.asarray(hysteresis, jnp.int32) if consecutive_hysteresis else state.hysteresis_left
    new_state = DynamicScaleState(
        growth_tracker=jnp.where(grow, reset_after_growth, tracker).astype(jnp.int32),
        hysteresis_left=jnp.where(finite, jnp.where(grow, hysteresis, kept), left).astype(jnp.int32))
    return new_scale.astype(jnp.float32), new_state

  return LossScalePolicy(init, update)


def torch_policy(init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> LossScalePolicy:
  """The scale trajectory of PyTorch ``torch.amp.GradScaler``.

  Grows on the ``growth_interval``-th consecutive finite step, backs off on
  every non-finite one; no hysteresis. Arguments have GradScaler's names and
  defaults.

  Exact while PyTorch's scale stays in ``[2**-126, 2**126]`` and both factors
  are float32-representable (PyTorch rounds the float64 product once, we round
  the factor and then the product; the two agree for such factors). Outside:
  PyTorch has no floor (its scale can reach 0) and refuses a growth only when
  the result would be inf; here the scale stops at ``2**-126`` and ``2**126``.

  Args:
    init_scale: float in [2**-126, 2**126]. Default ``2**16``.
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [1, 2**31 - 2]. Default 2000.

  Returns:
    A :class:`LossScalePolicy` with a :class:`DynamicScaleState`.

  Raises:
    ValueError: a value out of range (the message names it).
    TypeError: a wrong or traced value.
  """
  return _rule(init_scale=_scale("init_scale", init_scale),
               growth_factor=_growth("growth_factor", growth_factor),
               backoff_factor=_backoff("backoff_factor", backoff_factor),
               growth_after=_count("growth_interval", growth_interval))


def keras_policy(initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000) -> LossScalePolicy:
  """The scale trajectory of Keras 3 ``keras.optimizers.LossScaleOptimizer``.

  Doubles on the ``dynamic_growth_steps``-th consecutive finite step, halves
  on every non-finite step. Exact while Keras' scale stays in
  ``[2**-126, 2**126]``; Keras has neither floor nor ceiling (it reaches 0 and
  inf), here the scale stops at those bounds.

  Args:
    initial_scale: float in [2**-126, 2**126]. Default ``2**15``.
    dynamic_growth_steps: int in [1, 2**31 - 2]. Default 2000.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  return _rule(init_scale=_scale("initial_scale", initial_scale), growth_factor=2.0,
               backoff_factor=0.5, growth_after=_count("dynamic_growth_steps", dynamic_growth_steps))


def jmp_policy(loss_scale: float, period: int = 2000, factor: float = 2,
               min_loss_scale: float = 1.0) -> LossScalePolicy:
  """The scale trajectory of jmp ``jmp.DynamicLossScale``.

  Multiplies by ``factor`` on the ``period``-th consecutive finite step and
  divides by it (floored at ``min_loss_scale``) on every non-finite step.
  Exact while jmp's scale stays at or below ``2**126``; jmp refuses a growth
  that would give inf, here the scale stops at ``2**126``.

  Args:
    loss_scale: float in [2**-126, 2**126], the initial scale (required, as
      in jmp).
    period: int in [1, 2**31 - 2]. Default 2000.
    factor: number > 1, growth factor and backoff divisor. Default 2.
    min_loss_scale: float in [2**-126, loss_scale]. Default 1.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  factor = _growth("factor", factor)
  return _rule(init_scale=_scale("loss_scale", loss_scale), growth_factor=factor,
               backoff_divisor=factor, growth_after=_count("period", period),
               min_scale=_scale("min_loss_scale", min_loss_scale), names=("loss_scale", "min_loss_scale"))


def flax_policy(growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                scale: float = 65536.0, minimum_scale: float | None = SCALE_MIN) -> LossScalePolicy:
  """The scale trajectory of flax ``flax.training.dynamic_scale.DynamicScale``.

  flax grows on the ``growth_interval + 1``-th consecutive finite step (its
  ``fin_steps`` must equal ``growth_interval`` before the step), one step later
  than PyTorch. Its default floor is float32 ``tiny`` = ``2**-126``, ours too.
  Exact while flax's scale stays at or below ``2**126`` (flax caps at float32
  max) and the factors are float32-representable. ``minimum_scale=None`` (no
  floor in flax) floors at ``2**-126`` here.

  Args:
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [0, 2**31 - 3]. Default 2000.
    scale: float in [2**-126, 2**126], the initial scale. Default ``2**16``.
    minimum_scale: float in [2**-126, scale] or None. Default ``2**-126``.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  floor = SCALE_MIN if minimum_scale is None else _scale("minimum_scale", minimum_scale)
  interval = _count("growth_interval", growth_interval, low=0)
  return _rule(init_scale=_scale("scale", scale), growth_factor=_growth("growth_factor", growth_factor),
               backoff_factor=_backoff("backoff_factor", backoff_factor),
               growth_after=min(interval + 1, v.INT32_MAX - 1), min_scale=floor,
               names=("scale", "minimum_scale"))


def megatron_policy(initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                    backoff_factor: float = 0.5, growth_interval: int = 1000,
                    hysteresis: int = 2) -> LossScalePolicy:
  """The scale trajectory of Megatron-LM ``DynamicGradScaler``.

  Grows on the ``growth_interval``-th consecutive finite step and then refills
  the hysteresis; each non-finite step resets the growth tracker and spends
  one unit of hysteresis, and backs off (floored at ``min_scale``) once it is
  spent. Only a growth refills the hysteresis. Defaults are Megatron's
  command-line defaults (``--initial-loss-scale 2**32``, ``--min-loss-scale 1``,
  ``--loss-scale-window 1000``, ``--hysteresis 2``). Exact while Megatron's
  scale stays at or below ``2**126`` (it has no ceiling).

  Args:
    initial_scale: float in [min_scale, 2**126]. Default ``2**32``.
    min_scale: float in [2**-126, 2**126]. Default 1.
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [1, 2**31 - 2]. Default 1000.
    hysteresis: int in [1, 2**31 - 2]. Default 2.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  return _rule(init_scale=_scale("initial_scale", initial_scale),
               min_scale=_scale("min_scale", min_scale),
               growth_factor=_growth("growth_factor", growth_factor),
               backoff_factor=_backoff("backoff_factor", backoff_factor),
               growth_after=_count("growth_interval", growth_interval),
               hysteresis=_count("hysteresis", hysteresis), names=("initial_scale", "min_scale"))


def deepspeed_policy(init_scale: float = 2.0**16, scale_window: int = 1000, min_scale: float = 1.0,
                     delayed_shift: int = 2, consecutive_hysteresis: bool = False) -> LossScalePolicy:
  """The scale trajectory of DeepSpeed ``DynamicLossScaler`` (fp16 engine).

  DeepSpeed (0.19) grows by 2 when ``stable = cur_iter - last_overflow_iter - 1``
  is a positive multiple of ``scale_window``: the first growth comes on the
  ``scale_window + 1``-th consecutive finite step, later ones every
  ``scale_window`` finite steps. An overflow spends one unit of hysteresis
  (``delayed_shift``) and, once it is spent, halves the scale (floored at
  ``min_scale``). Only a growth refills the hysteresis, or every finite step
  with ``consecutive_hysteresis``. Defaults are DeepSpeed's fp16 config
  defaults (``initial_scale_power`` 16, ``loss_scale_window`` 1000,
  ``hysteresis`` 2, ``min_loss_scale`` 1).

  Exact while DeepSpeed's scale stays at or below ``2**126`` and
  ``init_scale`` / ``min_scale`` are float32-representable (DeepSpeed keeps a
  Python float). Where DeepSpeed raises an error (an overflow at
  ``min_scale`` with ``raise_error_at_min_scale``), the scale here stays at
  ``min_scale``. The growth timing reproduced is that of DeepSpeed 0.19.8.

  Args:
    init_scale: float in [min_scale, 2**126]. Default ``2**16``.
    scale_window: int in [1, 2**31 - 3]. Default 1000.
    min_scale: float in [2**-126, 2**126]. Default 1.
    delayed_shift: int in [1, 2**31 - 2], the hysteresis. Default 2.
    consecutive_hysteresis: bool. Default False.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  window = _count("scale_window", scale_window)
  v.check(window <= v.INT32_MAX - 2, "scale_window", window, "1 <= value <= 2**31 - 3")
  return _rule(init_scale=_scale("init_scale", init_scale), growth_factor=2.0, backoff_divisor=2.0,
               growth_after=window + 1, reset_after_growth=1,
               min_scale=_scale("min_scale", min_scale),
               hysteresis=_count("delayed_shift", delayed_shift),
               consecutive_hysteresis=_flag("consecutive_hysteresis", consecutive_hysteresis))
