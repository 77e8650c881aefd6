"""Other frameworks' scale trajectories, bit for bit, as :func:`optax_dls.config.preset` names.

References: PyTorch ``torch/amp/grad_scaler.py``, Megatron-LM
``megatron/core/optimizer/grad_scaler.py``, DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``,
Keras 3 ``keras/src/optimizers/loss_scale_optimizer.py``, jmp ``jmp/_src/loss_scale.py``, flax
``flax/training/dynamic_scale.py``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from optax_dls._policies.base import LossScalePolicy
from optax_dls._policies.dynamic import DynamicRule, dynamic_rule
from optax_dls._util import validation as _validation
from optax_dls._util.validation import INT32_MAX, SCALE_MAX, SCALE_MIN

_REQUIRED = inspect.Parameter.empty
# Each preset: fixed rule options, then (argument, default, role). Roles: "init" / "low" ("floor":
# None is 2**-126), "growth", "backoff", "factor" (growth factor and backoff divisor), "hysteresis",
# "consecutive", ("after", low, late): the growth window, grown ``late`` steps later.
_PRESETS: dict[str, tuple[dict[str, Any], tuple[tuple[str, Any, Any], ...]]] = {
  "torch": (
    {},
    (
      ("init_scale", 2.0**16, "init"),
      ("growth_factor", 2.0, "growth"),
      ("backoff_factor", 0.5, "backoff"),
      ("growth_interval", 2000, ("after", 1, 0)),
    ),
  ),
  "keras": (
    {"growth_factor": 2.0, "backoff_factor": 0.5},
    (("initial_scale", 2.0**15, "init"), ("dynamic_growth_steps", 2000, ("after", 1, 0))),
  ),
  "jmp": (
    {},
    (
      ("loss_scale", _REQUIRED, "init"),
      ("period", 2000, ("after", 1, 0)),
      ("factor", 2, "factor"),
      ("min_loss_scale", 1.0, "low"),
    ),
  ),
  "flax": (
    {},
    (
      ("growth_factor", 2.0, "growth"),
      ("backoff_factor", 0.5, "backoff"),
      ("growth_interval", 2000, ("after", 0, 1)),
      ("scale", 65536.0, "init"),
      ("minimum_scale", SCALE_MIN, "floor"),
    ),
  ),
  "megatron": (
    {},
    (
      ("initial_scale", 2.0**32, "init"),
      ("min_scale", 1.0, "low"),
      ("growth_factor", 2.0, "growth"),
      ("backoff_factor", 0.5, "backoff"),
      ("growth_interval", 1000, ("after", 1, 0)),
      ("hysteresis", 2, "hysteresis"),
    ),
  ),
  "deepspeed": (
    {"growth_factor": 2.0, "backoff_divisor": 2.0, "reset_after_growth": 1},
    (
      ("init_scale", 2.0**16, "init"),
      ("scale_window", 1000, ("after", 1, 1)),
      ("min_scale", 1.0, "low"),
      ("delayed_shift", 2, "hysteresis"),
      ("consecutive_hysteresis", False, "consecutive"),
    ),
  ),
}


def _option(role: Any, name: str, value: Any) -> dict[str, Any]:
  """The checked :class:`DynamicRule` options (or ``init`` / ``low``) of one argument."""
  if role in ("init", "low"):
    return {role: (name, value)}
  if role == "floor":
    return {"low": (name, SCALE_MIN if value is None else value)}
  if role == "growth":
    return {"growth_factor": _validation.growth_factor(name, value)}
  if role == "backoff":
    return {"backoff_factor": _validation.backoff_factor(name, value)}
  if role == "factor":
    factor = _validation.growth_factor(name, value)
    return {"growth_factor": factor, "backoff_divisor": factor}
  if role == "consecutive":
    return {"consecutive_hysteresis": _validation.boolean(name, value)}
  low, late = (1, 0) if role == "hysteresis" else role[1:]
  value = _validation.count(name, value, low=low, high=INT32_MAX - 1 - late)
  return {"hysteresis" if role == "hysteresis" else "growth_interval": value + late}


def _preset(name: str) -> Callable[..., LossScalePolicy]:
  """The policy function of the preset ``name``, with that framework's arguments."""
  fixed, arguments = _PRESETS[name]
  kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
  signature = inspect.Signature([inspect.Parameter(a, kind, default=d) for a, d, _ in arguments])

  def policy(*args: Any, **kwargs: Any) -> LossScalePolicy:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    options = dict(fixed, low=("min_scale", SCALE_MIN))
    for argument, _, role in arguments:
      options.update(_option(role, argument, bound.arguments[argument]))
    init, low = options.pop("init"), options.pop("low")
    init_scale, min_scale, _ = _validation.scale_range(init, low, ("max_scale", SCALE_MAX))
    rule = DynamicRule(init_scale=init_scale, min_scale=min_scale, max_scale=SCALE_MAX, **options)
    return dynamic_rule(rule)

  policy.__name__ = policy.__qualname__ = f"{name}_policy"
  policy.__doc__ = f"The scale trajectory of the {name!r} preset (see ``config.preset``)."
  policy.__signature__ = signature  # type: ignore[attr-defined]
  return policy


FRAMEWORKS: dict[str, Callable[..., LossScalePolicy]] = {name: _preset(name) for name in _PRESETS}
