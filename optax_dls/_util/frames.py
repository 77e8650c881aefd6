"""Where a warning points: the user's line, past this package, JAX, optax, flax, Equinox."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import FrameType


@functools.cache
def library_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
  """The folders of the installed packages among ``names``, each ending in a separator."""
  specs = [importlib.util.find_spec(name) for name in names]
  return tuple(os.path.join(p, "") for s in specs if s for p in s.submodule_search_locations or ())


def user_stacklevel() -> int:
  """The ``stacklevel`` naming the caller's first frame outside those libraries."""
  frame: FrameType | None = sys._getframe(2)
  level = 2
  folders = library_dirs(("optax_dls", "jax", "jaxlib", "optax", "flax", "equinox"))
  while frame is not None and frame.f_code.co_filename.startswith(folders):
    frame, level = frame.f_back, level + 1
  return level
