"""Where a jaxpr equation came from: the user's ``file:line``, function and named scope.

The only module that reads JAX's private ``jax._src.source_info_util``; if a
JAX release moves it, ``source`` and ``function`` fall back to ``"?"`` and the
named scope (a public attribute of ``eqn.source_info``) still works.
"""

from __future__ import annotations

import os
from typing import Any

try:  # JAX-internal: the traceback an equation was traced with, resolved to frames.
  from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - only with a JAX that moved the module
  _siu = None  # type: ignore[assignment]

# Library frames skipped when looking for the user's frame, besides JAX's own:
# a layer's dot_general is written in flax or equinox, but the user wrote the call.
_LIBRARIES = ("flax", "equinox", "optax_dls", "optax", "jmp")


def _library_dirs() -> tuple[str, ...]:
  import importlib.util

  dirs: list[str] = []
  for name in _LIBRARIES:
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
      dirs.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
  return tuple(dirs)


_DIRS: tuple[str, ...] | None = None


def _user_frames(traceback: Any) -> list[tuple[str, int, str]]:
  """The user's frames, innermost first: (file name, line, qualified function name)."""
  global _DIRS
  if _siu is None or traceback is None:
    return []
  if _DIRS is None:
    _DIRS = _library_dirs()
  try:
    codes, lastis = traceback.raw_frames()
  except Exception:  # noqa: BLE001 - an unknown traceback type: no source
    return []
  frames = []
  for code, lasti in zip(codes, lastis):
    name = code.co_filename
    if not _siu.is_user_filename(name) or name.startswith(_DIRS):
      continue
    frame = _siu.raw_frame_to_frame(code, lasti)
    qualname = getattr(code, "co_qualname", code.co_name)
    frames.append((name, int(frame.start_line), str(qualname)))
  return frames


def source_of(eqn: Any) -> tuple[str, str]:
  """``("file:line", "qualified.function")`` of the user's code that wrote ``eqn``;
  ``("?", "?")`` when unknown."""
  frames = _user_frames(getattr(eqn.source_info, "traceback", None))
  if not frames:
    return "?", "?"
  file_name, line, qualname = frames[0]
  return f"{file_name}:{line}", qualname


def scope_of(eqn: Any) -> str:
  """The named scope ``eqn`` ran in (``jax.named_scope``, flax linen's module path),
  without the ``jvp``/``transpose`` transforms; ``""`` at the top level."""
  stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
  names = [s.name for s in stack if type(s).__name__ == "Scope"]
  return "/".join(names)
