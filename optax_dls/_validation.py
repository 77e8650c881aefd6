"""Checks of static hyperparameters, run at construction before any compilation."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np


def _concrete(name: str, value: Any) -> Any:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a static Python number, got a traced value {value!r}. "
        "Hyperparameters are fixed when the transformation is built: build it "
        "outside jax.jit / vmap / grad, or close over a Python number.")
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.ndim(value) == 0:
    return value.item()
  return value


def real(name: str, value: Any) -> float:
  """Returns ``value`` as a float; TypeError for non-numbers, traced values and bools."""
  value = _concrete(name, value)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}.")
  value = float(value)
  if math.isnan(value):
    raise ValueError(f"{name} must not be NaN, got {value!r}.")
  return value


def integer(name: str, value: Any) -> int:
  """Returns ``value`` as an int; TypeError for non-integers, traced values and bools."""
  value = _concrete(name, value)
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
  return int(value)


def check(ok: bool, name: str, value: Any, rule: str) -> None:
  """Raises ValueError naming ``name`` and ``value`` unless ``ok``."""
  if not ok:
    raise ValueError(f"{name} must satisfy {rule}, got {name}={value!r}.")


INT32_MAX = 2**31 - 1
