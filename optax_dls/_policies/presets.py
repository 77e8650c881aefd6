"""The presets reproducing other frameworks' scale trajectories, public as
``optax_dls.config.preset("torch")``, ``"keras"``, ``"jmp"``, ``"flax"``, ``"megatron"`` and
``"deepspeed"`` (documented in ``docs/policies.md``).

Given the same finite / non-finite steps, each scale equals the reference's bit for bit while
the reference stays inside ``[2**-126, 2**126]``; other conditions are listed per preset.
References: PyTorch ``torch/amp/grad_scaler.py``, Megatron-LM
``megatron/core/optimizer/grad_scaler.py``, DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``,
Keras 3 ``keras/src/optimizers/loss_scale_optimizer.py``, jmp ``jmp/_src/loss_scale.py``, flax
``flax/training/dynamic_scale.py``; the rule is Micikevicius et al. (2018), Sec. 3.2.
"""

from __future__ import annotations

from typing import Any

from optax_dls._policies.base import LossScalePolicy
from optax_dls._policies.dynamic import DynamicRule, dynamic_rule
from optax_dls._util import validation as _validation
from optax_dls._util.validation import SCALE_MAX, SCALE_MIN


def _rule(
  *, init: tuple[str, Any], low: tuple[str, Any] = ("min_scale", SCALE_MIN), **options: Any
) -> LossScalePolicy:
  """:func:`dynamic_rule` with checked ``low <= init`` and no ceiling below ``2**126``."""
  init_scale, min_scale, _ = _validation.scale_range(init, low, ("max_scale", SCALE_MAX))
  rule = DynamicRule(init_scale=init_scale, min_scale=min_scale, max_scale=SCALE_MAX, **options)
  return dynamic_rule(rule)


def _window(name: str, value: Any, low: int = 1) -> int:
  return _validation.count(name, value, low=low, high=_validation.INT32_MAX - 1)


def torch_policy(
  init_scale: float = 2.0**16,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
) -> LossScalePolicy:
  """The scale trajectory of PyTorch ``torch.amp.GradScaler``.

  Grows on the ``growth_interval``-th consecutive finite step, backs off on every
  non-finite one; no hysteresis; GradScaler's names and defaults. Exact while both factors
  are float32-representable (PyTorch rounds the float64 product once); PyTorch has no
  floor and refuses only a growth to inf, here the scale stops at ``2**-126`` / ``2**126``.

  Args:
    init_scale: float in [2**-126, 2**126]. Default ``2**16``.
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [1, 2**31 - 2]. Default 2000.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state.

  Raises:
    ValueError: a value out of range (the message names it).
    TypeError: a wrong or traced value.
  """
  return _rule(
    init=("init_scale", init_scale),
    growth_factor=_validation.growth_factor("growth_factor", growth_factor),
    backoff_factor=_validation.backoff_factor("backoff_factor", backoff_factor),
    growth_after=_window("growth_interval", growth_interval),
  )


def keras_policy(
  initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000
) -> LossScalePolicy:
  """The scale trajectory of Keras 3 ``keras.optimizers.LossScaleOptimizer``.

  Doubles on the ``dynamic_growth_steps``-th consecutive finite step, halves on every
  non-finite one. Keras has neither floor nor ceiling; here the scale stops at the bounds.

  Args:
    initial_scale: float in [2**-126, 2**126]. Default ``2**15``.
    dynamic_growth_steps: int in [1, 2**31 - 2]. Default 2000.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  return _rule(
    init=("initial_scale", initial_scale),
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_after=_window("dynamic_growth_steps", dynamic_growth_steps),
  )


def jmp_policy(
  loss_scale: float, period: int = 2000, factor: float = 2, min_loss_scale: float = 1.0
) -> LossScalePolicy:
  """The scale trajectory of jmp ``jmp.DynamicLossScale``.

  Multiplies by ``factor`` on the ``period``-th consecutive finite step and divides by it
  (floored at ``min_loss_scale``) on every non-finite one; stops at ``2**126``.

  Args:
    loss_scale: float in [2**-126, 2**126], the initial scale (required, as
      in jmp).
    period: int in [1, 2**31 - 2]. Default 2000.
    factor: number > 1, growth factor and backoff divisor. Default 2.
    min_loss_scale: float in [2**-126, loss_scale]. Default 1.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  factor = _validation.growth_factor("factor", factor)
  return _rule(
    init=("loss_scale", loss_scale),
    low=("min_loss_scale", min_loss_scale),
    growth_factor=factor,
    backoff_divisor=factor,
    growth_after=_window("period", period),
  )


def flax_policy(
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  scale: float = 65536.0,
  minimum_scale: float | None = SCALE_MIN,
) -> LossScalePolicy:
  """The scale trajectory of flax ``flax.training.dynamic_scale.DynamicScale``.

  Grows on the ``growth_interval + 1``-th consecutive finite step, one later than PyTorch;
  the default floor is float32 ``tiny`` = ``2**-126``, as in flax (``None`` floors there
  too). Exact for float32-representable factors; flax caps at float32 max, here ``2**126``.

  Args:
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [0, 2**31 - 3]. Default 2000.
    scale: float in [2**-126, 2**126], the initial scale. Default ``2**16``.
    minimum_scale: float in [2**-126, scale] or None. Default ``2**-126``.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  floor = SCALE_MIN if minimum_scale is None else minimum_scale
  interval = _validation.count(
    "growth_interval", growth_interval, low=0, high=_validation.INT32_MAX - 2
  )
  return _rule(
    init=("scale", scale),
    low=("minimum_scale", floor),
    growth_factor=_validation.growth_factor("growth_factor", growth_factor),
    backoff_factor=_validation.backoff_factor("backoff_factor", backoff_factor),
    growth_after=interval + 1,
  )


def megatron_policy(
  initial_scale: float = 2.0**32,
  min_scale: float = 1.0,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 1000,
  hysteresis: int = 2,
) -> LossScalePolicy:
  """The scale trajectory of Megatron-LM ``DynamicGradScaler``.

  Grows on the ``growth_interval``-th consecutive finite step, refilling the hysteresis
  (only a growth does); a non-finite step resets the tracker, spends one unit of
  hysteresis and, once spent, backs off (floored at ``min_scale``). Megatron's command-line
  defaults; Megatron has no ceiling, here ``2**126``.

  Args:
    initial_scale: float in [min_scale, 2**126]. Default ``2**32``.
    min_scale: float in [2**-126, 2**126]. Default 1.
    growth_factor: float > 1. Default 2.
    backoff_factor: float in (0, 1). Default 0.5.
    growth_interval: int in [1, 2**31 - 2]. Default 1000.
    hysteresis: int in [1, 2**31 - 2]. Default 2.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  return _rule(
    init=("initial_scale", initial_scale),
    low=("min_scale", min_scale),
    growth_factor=_validation.growth_factor("growth_factor", growth_factor),
    backoff_factor=_validation.backoff_factor("backoff_factor", backoff_factor),
    growth_after=_window("growth_interval", growth_interval),
    hysteresis=_window("hysteresis", hysteresis),
  )


def deepspeed_policy(
  init_scale: float = 2.0**16,
  scale_window: int = 1000,
  min_scale: float = 1.0,
  delayed_shift: int = 2,
  consecutive_hysteresis: bool = False,
) -> LossScalePolicy:
  """The scale trajectory of DeepSpeed ``DynamicLossScaler`` (fp16 engine).

  Grows by 2 on the ``scale_window + 1``-th consecutive finite step, then every
  ``scale_window`` (DeepSpeed 0.19.8's timing). An overflow spends one unit of hysteresis
  (``delayed_shift``) and, once spent, halves the scale (floored at ``min_scale``); a
  growth refills it, or every finite step with ``consecutive_hysteresis``. DeepSpeed's fp16
  config defaults. Exact for float32-representable ``init_scale`` / ``min_scale``; where
  DeepSpeed raises (``raise_error_at_min_scale``) the scale stays at ``min_scale``.

  Args:
    init_scale: float in [min_scale, 2**126]. Default ``2**16``.
    scale_window: int in [1, 2**31 - 3]. Default 1000.
    min_scale: float in [2**-126, 2**126]. Default 1.
    delayed_shift: int in [1, 2**31 - 2], the hysteresis. Default 2.
    consecutive_hysteresis: bool. Default False.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state.

  Raises:
    ValueError / TypeError: as :func:`torch_policy`.
  """
  window = _validation.count("scale_window", scale_window, high=_validation.INT32_MAX - 2)
  return _rule(
    init=("init_scale", init_scale),
    low=("min_scale", min_scale),
    growth_factor=2.0,
    backoff_divisor=2.0,
    growth_after=window + 1,
    reset_after_growth=1,
    hysteresis=_window("delayed_shift", delayed_shift),
    consecutive_hysteresis=_validation.boolean("consecutive_hysteresis", consecutive_hysteresis),
  )
