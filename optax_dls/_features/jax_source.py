"""Where a jaxpr equation came from (the user's ``file:line``, function, scope, call) and where a
constant overflowed; the only reader of JAX's private ``source_info_util``."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from optax_dls._util import frames as _frames

try:  # JAX-internal: the traceback an equation was traced with, resolved to frames.
  from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - only with a JAX that moved the module
  _siu = None  # type: ignore[assignment]

# Frames skipped besides JAX's: a layer's dot_general is in flax, but the user wrote the call.
_LIBRARIES: tuple[str, ...] = ("flax", "equinox", "optax_dls", "optax", "jmp", "numpy", "scipy")
_LIBRARIES += ("ml_dtypes", "opt_einsum")


def _user_frame(traceback: Any) -> tuple[str, int, str] | None:
  """The user's innermost frame: (file name, line, qualified function name); None when unknown."""
  if _siu is None or traceback is None:
    return None
  try:
    codes, lastis = traceback.raw_frames()
  except Exception:  # noqa: BLE001 - an unknown traceback type: no source
    return None
  for code, lasti in zip(codes, lastis):
    if _is_user_code(code):
      line = int(_siu.raw_frame_to_frame(code, lasti).start_line)
      return code.co_filename, line, str(getattr(code, "co_qualname", code.co_name))
  return None


def _is_user_code(code: Any) -> bool:
  name = code.co_filename
  return (
    _siu is not None
    and _siu.is_user_filename(name)
    and not name.startswith(_frames.library_dirs(_LIBRARIES))
  )


def source_of(eqn: Any) -> tuple[str, str]:
  """``("file:line", "qualified.function")`` of the user's code that wrote ``eqn``, or ``?``s."""
  frame = _user_frame(getattr(eqn.source_info, "traceback", None))
  return ("?", "?") if frame is None else (f"{frame[0]}:{frame[1]}", frame[2])


CALL = "optax_dls_locate_call:"  # the scope a user's call opens while locate traces
# Equinox's layers open scopes named by type: inside a block instance, its path names it.
_TYPE_SCOPES = ("eqx.",)


def scopes(eqn: Any, outer: Sequence[str] = ()) -> list[str]:
  """The named scopes ``eqn`` ran in, outermost first, after ``outer`` (its caller's)."""
  stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
  return [*outer, *(s.name for s in stack if type(s).__name__ == "Scope")]


def scope_of(
  eqn: Any, outer: Sequence[str] = (), instances: Mapping[str, str] | None = None
) -> str:
  """``eqn``'s scope from the innermost block instance (named by its path); ``""`` at the top."""
  parts: list[str] = []
  inside = False
  for name in scopes(eqn, outer):
    if name.startswith(CALL):
      path = (instances or {}).get(name, "")
      if path:
        parts, inside = [path], True
    elif not (inside and name.startswith(_TYPE_SCOPES)):
      parts.append(name)
  return "/".join(parts)


@dataclasses.dataclass
class Watch:
  """What :func:`watching` saw."""

  calls: list[str] = dataclasses.field(default_factory=list)  # each user call's scope, in order
  given: dict[str, Any] = dataclasses.field(default_factory=dict)  # describe(args) per call
  # (file, function, line) where NumPy overflowed making a constant
  overflows: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
  instances: dict[str, str] = dataclasses.field(default_factory=dict)  # call -> path, by locate

  def made_here(self, eqn: Any) -> bool:
    """Whether a constant overflowed in the function that wrote ``eqn``, at or before its line."""
    frame = _user_frame(getattr(eqn.source_info, "traceback", None))
    return frame is not None and any(
      (f, q) == (frame[0], frame[2]) and n <= frame[1] for f, q, n in self.overflows
    )


_NUMBERS = itertools.count()
_SKIPPED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_SITE = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib")})


@contextlib.contextmanager
def watching(describe: Callable[[list[Any]], Any] | None = None) -> Iterator[Watch]:
  """While tracing, each user call but a linen method opens a scope, ``describe`` getting its
  positional arguments (not under another profiler), and NumPy overflows are noted."""
  watch = Watch()
  if _siu is None:
    yield watch
    return
  hook = _Hook(watch, describe)
  previous = sys.getprofile()
  if previous is None:
    sys.setprofile(hook)
  try:
    with np.errstate(over="call", call=hook.overflow):
      yield watch
  finally:
    if previous is None:
      sys.setprofile(None)
    hook.close()


class _Hook:
  """:func:`watching`'s profile function and NumPy error callback."""

  def __init__(self, watch: Watch, describe: Callable[[list[Any]], Any] | None) -> None:
    self.watch = watch
    self.describe = describe
    self.eligible: dict[Any, bool] = {}
    self.opened: list[tuple[Any, Any]] = []  # (frame, scope), innermost last

  def __call__(self, frame: Any, event: str, arg: Any) -> None:
    if event == "call":
      self.enter(frame)
    elif event == "return" and self.opened and self.opened[-1][0] is frame:
      self.opened.pop()[1].__exit__(None, None, None)

  def enter(self, frame: Any) -> None:
    code = frame.f_code
    ok = self.eligible.get(code)
    if ok is None:
      ok = self.eligible[code] = _eligible(code)
    if not ok:
      return
    args = _positional(frame)
    linen = sys.modules.get("flax.linen")
    if args and linen is not None and isinstance(args[0], linen.Module):
      return
    name = f"{CALL}{next(_NUMBERS)}"  # unique across traces: names never mix
    if self.describe is not None:
      self.watch.given[name] = self.describe(args)
    scope = jax.named_scope(name)
    scope.__enter__()
    self.watch.calls.append(name)
    self.opened.append((frame, scope))

  def overflow(self, kind: str, flag: int) -> None:
    del kind, flag
    frame = _user_frame(_siu.current().traceback)
    if frame is not None:
      self.watch.overflows.append((frame[0], frame[2], frame[1]))

  def close(self) -> None:
    while self.opened:  # an exception left the trace: close what is still open
      self.opened.pop()[1].__exit__(None, None, None)


def _positional(frame: Any) -> list[Any]:
  """The positional arguments of the call ``frame`` runs (``*args`` included)."""
  code, values = frame.f_code, frame.f_locals
  out = [values.get(name) for name in code.co_varnames[: code.co_argcount]]
  if code.co_flags & inspect.CO_VARARGS:
    out.extend(values.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount]) or ())
  return out


def _eligible(code: Any) -> bool:
  """A user function whose call opens a scope: no generator, ``__enter__``/``__exit__``, module
  body, comprehension, nor the import system's or the standard library's."""
  name, function = code.co_filename, code.co_name
  skipped = bool(code.co_flags & _SKIPPED) or function in ("__enter__", "__exit__")
  skipped |= function.startswith("<") and function != "<lambda>"
  skipped |= name.startswith("<frozen ") or (
    name.startswith(_STDLIB) and not name.startswith(_SITE)
  )
  return not skipped and _is_user_code(code)
