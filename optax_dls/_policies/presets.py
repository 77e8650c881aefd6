"""The presets that reproduce other frameworks' scale trajectories, public as
``optax_dls.config.preset("torch")``, ``"keras"``, ``"jmp"``, ``"flax"``, ``"megatron"`` and
``"deepspeed"`` (documented there and in ``docs/policies.md``).

Each returns a :class:`~optax_dls.LossScalePolicy` whose scale, given the same sequence of
finite / non-finite steps, equals the reference implementation's scale bit for bit, as long
as the reference stays inside ``[2**-126, 2**126]`` (the range of every optax_dls scale,
where ``1/S`` is a normal float32 number). Where each reference leaves that range, and the
other conditions for exactness, are listed per preset.

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

from optax_dls._policies.base import LossScalePolicy
from optax_dls._policies.dynamic import DynamicRule, dynamic_rule
from optax_dls._util import validation as _validation
from optax_dls._util.validation import SCALE_MAX, SCALE_MIN


def _rule(
  *, init: tuple[str, Any], low: tuple[str, Any] = ("min_scale", SCALE_MIN), **options: Any
) -> LossScalePolicy:
  """:func:`optax_dls._policies.dynamic_rule` with a checked ``low <= init`` pair (each
  a ``(name, value)``) and no ceiling below ``2**126``, as in the references."""
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
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state (``growth_tracker``,
    ``hysteresis_left``).

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

  Doubles on the ``dynamic_growth_steps``-th consecutive finite step, halves
  on every non-finite step. Exact while Keras' scale stays in
  ``[2**-126, 2**126]``; Keras has neither floor nor ceiling (it reaches 0 and
  inf), here the scale stops at those bounds.

  Args:
    initial_scale: float in [2**-126, 2**126]. Default ``2**15``.
    dynamic_growth_steps: int in [1, 2**31 - 2]. Default 2000.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state, as
    :func:`torch_policy`.

  Raises:
    ValueError: a value out of range, as in :func:`torch_policy` (the message names it).
    TypeError: a wrong or traced value, as in :func:`torch_policy`.
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

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state, as
    :func:`torch_policy`.

  Raises:
    ValueError: a value out of range, as in :func:`torch_policy` (the message names it).
    TypeError: a wrong or traced value, as in :func:`torch_policy`.
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

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state, as
    :func:`torch_policy`.

  Raises:
    ValueError: a value out of range, as in :func:`torch_policy` (the message names it).
    TypeError: a wrong or traced value, as in :func:`torch_policy`.
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

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state, as
    :func:`torch_policy`.

  Raises:
    ValueError: a value out of range, as in :func:`torch_policy` (the message names it).
    TypeError: a wrong or traced value, as in :func:`torch_policy`.
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

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state, as
    :func:`torch_policy`.

  Raises:
    ValueError: a value out of range, as in :func:`torch_policy` (the message names it).
    TypeError: a wrong or traced value, as in :func:`torch_policy`.
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
