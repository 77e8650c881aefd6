"""Checks of static hyperparameters, run at construction before any compilation."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def _concrete(name: str, value: Any) -> Any:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} must be a static Python number, got a traced value {value!r}. "
      "Hyperparameters are fixed when the transformation is built: build it "
      "outside jax.jit / vmap / grad, or close over a Python number."
    )
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.ndim(value) == 0:
    return value.item()
  return value


def _number(name: str, value: Any, kind: type, what: str) -> Any:
  """``value`` (a 0-d array as its number) if it is a ``kind`` and not a bool; else TypeError."""
  value = _concrete(name, value)
  if isinstance(value, bool) or not isinstance(value, kind):
    raise TypeError(f"{name} must be {what}, got {value!r} of type {type(value).__name__}.")
  return value


def real(name: str, value: Any) -> float:
  """Returns ``value`` as a float; TypeError for non-numbers, traced values and bools."""
  value = _number(name, value, numbers.Real, "a real number")
  try:
    value = float(value)
  except OverflowError:
    raise ValueError(f"{name} is too large to be a float, got {name}={value!r}.") from None
  if math.isnan(value):
    raise ValueError(f"{name} must not be NaN, got {value!r}.")
  return value


def boolean(name: str, value: Any) -> bool:
  """``value`` as a bool (``bool`` or ``numpy.bool_``); TypeError otherwise."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} must be a static bool, got a traced value {value!r}. It is fixed when the "
      "transformation is built: build it outside jax.jit / vmap / grad, or pass a Python bool."
    )
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}.")
  return bool(value)


def float32(name: str, value: float, ok: Callable[[float], bool], rule: str) -> float:
  """Checks ``rule`` on ``value`` rounded to float32 (``1 - 1e-9`` rounds to 1)."""
  with np.errstate(over="ignore", under="ignore"):
    rounded = float(np.float32(value))
  if not ok(rounded):
    raise ValueError(
      f"{name} must satisfy {rule} in float32, got {name}={value!r}, which rounds to "
      f"{rounded!r} in float32."
    )
  return value


def integer(name: str, value: Any) -> int:
  """Returns ``value`` as an int; TypeError for non-integers, traced values and bools."""
  return int(_number(name, value, numbers.Integral, "an integer"))


def check(ok: bool, name: str, value: Any, rule: str) -> None:
  """Raises ValueError naming ``name`` and ``value`` unless ``ok``."""
  if not ok:
    raise ValueError(f"{name} must satisfy {rule}, got {name}={value!r}.")


INT32_MAX = 2**31 - 1
# Every loss scale lives in [2**-126, 2**126], where 1/S is a normal float32 number.
SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126


def count(name: str, value: Any, low: int = 1, high: int = INT32_MAX) -> int:
  """An integer in ``[low, high]`` (a step count, an interval); TypeError / ValueError otherwise."""
  value = integer(name, value)
  check(low <= value <= high, name, value, f"{low} <= value <= {high}")
  return value


def scale(name: str, value: Any, low: float = SCALE_MIN, high: float = SCALE_MAX) -> float:
  """A loss scale (or factor) as a float in ``[low, high]``, by default ``[2**-126, 2**126]``."""
  value = real(name, value)
  check(low <= value <= high, name, value, f"{scale_text(low)} <= value <= {scale_text(high)}")
  return value


def scale_range(
  init: tuple[str, Any], low: tuple[str, Any], high: tuple[str, Any]
) -> tuple[float, float, float]:
  """Checks ``low <= init <= high``, each a ``(name, value)`` scale; the three floats."""
  (i_name, i), (lo_name, lo), (hi_name, hi) = init, low, high
  lo, hi = scale(lo_name, lo), scale(hi_name, hi)
  check(lo <= hi, hi_name, hi, f"{hi_name} >= {lo_name}={lo!r}")
  i = scale(i_name, i)
  rule = (
    f"{lo_name}={lo!r} <= {i_name} <= {hi_name}={hi!r} (pass {i_name} within the range when "
    f"you change {lo_name} or {hi_name}: it has a default of its own)"
  )
  check(lo <= i <= hi, i_name, i, rule)
  return i, lo, hi


def scale_text(value: float) -> str:
  exponent = math.log2(value) if value > 0 else None
  if exponent is not None and exponent.is_integer() and abs(exponent) > 10:
    return f"2**{int(exponent)}"
  return repr(value)


def _open(name: str, value: Any, low: float, high: float, rule: str) -> float:
  """A number in ``(low, high)``, also after rounding to float32."""
  value = real(name, value)
  check(low < value < high, name, value, rule)
  return float32(name, value, lambda r: low < r < high, rule)


def growth_factor(name: str, value: Any) -> float:
  return _open(name, value, 1.0, math.inf, "1 < value < inf")


def backoff_factor(name: str, value: Any) -> float:
  return _open(name, value, 0.0, 1.0, "0 < value < 1")


def argnums(value: Any) -> int | tuple[int, ...]:
  """``argnums`` as in ``jax.grad``: an int >= 0 or a non-empty tuple of distinct ones."""
  ok = isinstance(value, (int, np.integer)) or (
    isinstance(value, tuple) and value and all(isinstance(i, (int, np.integer)) for i in value)
  )
  bools = value if isinstance(value, tuple) else (value,)
  if not ok or any(isinstance(i, (bool, np.bool_)) for i in bools):
    raise TypeError(
      f"argnums must be an int or a non-empty tuple of ints, got {value!r} "
      f"of type {type(value).__name__}."
    )
  nums = tuple(int(i) for i in bools)
  if any(i < 0 for i in nums):
    raise ValueError(f"argnums must be >= 0, got argnums={value!r}.")
  if len(set(nums)) != len(nums):
    raise ValueError(f"argnums must not repeat an argument, got argnums={value!r}.")
  return nums[0] if not isinstance(value, tuple) else nums


def function(name: str, value: Any) -> Any:
  """``value`` if callable; TypeError naming ``name`` otherwise."""
  if not callable(value):
    raise TypeError(f"{name} must be callable, got {value!r} of type {type(value).__name__}.")
  return value


def arrays(name: str, tree: Any) -> Any:
  """``tree`` if every leaf is an array or a number; TypeError naming the leaf otherwise."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
      raise TypeError(
        f"{name} must be a pytree of arrays, got the leaf {leaf!r} of type "
        f"{type(leaf).__name__} at {name}{jax.tree_util.keystr(path)}."
      )
  return tree
