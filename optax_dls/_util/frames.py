"""Where a warning points: the user's line, past this package, JAX, optax, flax, Equinox."""

from __future__ import annotations

import os
import sys
from types import FrameType

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = ("jax", "optax", "flax", "equinox")


def _folders() -> tuple[str, ...]:
  """This package's folder and those of the libraries imported so far."""
  found = [_OURS]
  for name in _LIBRARIES:
    path = getattr(sys.modules.get(name), "__file__", None)
    if path:
      found.append(os.path.dirname(os.path.abspath(path)))
  return tuple(found)


def user_stacklevel() -> int:
  """The ``stacklevel`` naming the caller's first frame outside those libraries."""
  frame: FrameType | None = sys._getframe(2)
  level = 2
  folders = _folders()
  while frame is not None and frame.f_code.co_filename.startswith(folders):
    frame, level = frame.f_back, level + 1
  return level
