"""Where a warning points: the user's line, past the frames of this package and JAX."""

from __future__ import annotations

import os
import sys
from types import FrameType

import jax

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX = os.path.dirname(os.path.abspath(jax.__file__))


def user_stacklevel() -> int:
  """The ``stacklevel`` for ``warnings.warn`` called by the caller of this function that
  names the first frame outside optax_dls and JAX."""
  frame: FrameType | None = sys._getframe(2)
  level = 2
  while frame is not None and frame.f_code.co_filename.startswith((_OURS, _JAX)):
    frame, level = frame.f_back, level + 1
  return level
