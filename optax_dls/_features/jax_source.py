"""Where a jaxpr equation came from: the user's ``file:line``, function and named scope,
and, while :func:`watching`, which call of the user's code made it and where a constant
overflowed as it was made.

The only module that reads JAX's private ``jax._src.source_info_util``; if a
JAX release moves it, ``source`` and ``function`` fall back to ``"?"``, no call is
told apart, and the named scope (a public attribute of ``eqn.source_info``) still works.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

try:  # JAX-internal: the traceback an equation was traced with, resolved to frames.
  from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - only with a JAX that moved the module
  _siu = None  # type: ignore[assignment]

# Library frames skipped when looking for the user's frame, besides JAX's own:
# a layer's dot_general is written in flax or equinox, but the user wrote the call;
# and JAX's own dependencies, which it calls while tracing.
_LIBRARIES = (
  "flax",
  "equinox",
  "optax_dls",
  "optax",
  "jmp",
  "numpy",
  "ml_dtypes",
  "opt_einsum",
  "scipy",
)


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
  if _siu is None or traceback is None:
    return []
  try:
    codes, lastis = traceback.raw_frames()
  except Exception:  # noqa: BLE001 - an unknown traceback type: no source
    return []
  frames = []
  for code, lasti in zip(codes, lastis):
    if not _is_user_code(code):
      continue
    frame = _siu.raw_frame_to_frame(code, lasti)
    qualname = getattr(code, "co_qualname", code.co_name)
    frames.append((code.co_filename, int(frame.start_line), str(qualname)))
  return frames


def _is_user_code(code: Any) -> bool:
  global _DIRS
  if _DIRS is None:
    _DIRS = _library_dirs()
  name = code.co_filename
  return _siu is not None and _siu.is_user_filename(name) and not name.startswith(_DIRS)


def source_of(eqn: Any) -> tuple[str, str]:
  """``("file:line", "qualified.function")`` of the user's code that wrote ``eqn``;
  ``("?", "?")`` when unknown."""
  frames = _user_frames(getattr(eqn.source_info, "traceback", None))
  if not frames:
    return "?", "?"
  file_name, line, qualname = frames[0]
  return f"{file_name}:{line}", qualname


# The scope a call of the user's code opens while locate traces: this prefix and a number.
CALL = "optax_dls_locate_call:"
# Scopes Equinox's layers open, named by the layer's type (every eqx.nn.Linear shares
# one): inside a block instance, its path names the place instead.
_TYPE_SCOPES = ("eqx.",)


def scopes(eqn: Any, outer: Sequence[str] = ()) -> list[str]:
  """The named scopes ``eqn`` ran in, outermost first, after ``outer`` (those of the call
  whose body holds it: a jitted function's equations start a new stack), without the
  ``jvp``/``transpose`` transforms; the calls :func:`watching` saw among them."""
  stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
  return [*outer, *(s.name for s in stack if type(s).__name__ == "Scope")]


def scope_of(
  eqn: Any, outer: Sequence[str] = (), instances: Mapping[str, str] | None = None
) -> str:
  """The named scope ``eqn`` ran in (``jax.named_scope``, flax linen's module path), or,
  inside a call :func:`watching` saw that ``instances`` names (a block of the model, by
  its path), that name and the named scopes opened inside it; ``""`` at the top level."""
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


class Watch:
  """What :func:`watching` saw while a function was traced.

  Attributes:
    calls: the scope each call of the user's code opened (:data:`CALL` and a number), in
      the order they were made.
    given: per call, what ``describe`` said of its positional arguments.
    overflows: ``(file, function, line)`` of the user's code where NumPy overflowed
      while making a constant (``jnp.float16(1e5)``, ``x + 1e5`` with a float16 ``x``).
  """

  def __init__(self) -> None:
    self.calls: list[str] = []
    self.given: dict[str, Any] = {}
    self.overflows: list[tuple[str, str, int]] = []

  def made_here(self, eqn: Any) -> bool:
    """Whether a constant overflowed in the user's function that wrote ``eqn``, on its
    line or an earlier one (``big = jnp.float16(1e5)``, then ``x * big``)."""
    frames = _user_frames(getattr(eqn.source_info, "traceback", None))
    if not frames:
      return False
    file_name, line, function = frames[0]
    return any(f == file_name and q == function and n <= line for f, q, n in self.overflows)


_NUMBERS = itertools.count()
_SKIPPED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_SITE = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib")})


@contextlib.contextmanager
def watching(describe: Callable[[list[Any]], Any] | None = None) -> Iterator[Watch]:
  """While tracing: every call of the user's code (not a generator, an ``__enter__`` or
  a comprehension, nor a flax linen module's method: linen names its modules itself)
  opens a named scope of its own, so that the equations of two calls of one block can
  be told apart, and ``describe`` is given its positional arguments; and a NumPy
  overflow (a Python float beyond float16's range cast to it, as JAX makes a constant)
  is noted with the user's line that caused it. Nothing of it is left after: the
  profile function and NumPy's error handling are restored. Under another profiler
  (``sys.getprofile()`` set), calls are not told apart."""
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
  """The profile function of :func:`watching`, and its NumPy error callback."""

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
    frames = _user_frames(_siu.current().traceback)
    if frames:
      file_name, line, function = frames[0]
      self.watch.overflows.append((file_name, function, line))

  def close(self) -> None:
    while self.opened:  # an exception left the trace: close what is still open
      self.opened.pop()[1].__exit__(None, None, None)


def _positional(frame: Any) -> list[Any]:
  """The positional arguments of the call ``frame`` runs (``*args`` included)."""
  code = frame.f_code
  n = code.co_argcount
  names = list(code.co_varnames[:n])
  if code.co_flags & inspect.CO_VARARGS:
    names.append(code.co_varnames[n + code.co_kwonlyargcount])
  values = frame.f_locals
  out: list[Any] = []
  for i, name in enumerate(names):
    value = values.get(name)
    if i == n:
      out.extend(value or ())
    else:
      out.append(value)
  return out


def _eligible(code: Any) -> bool:
  """A function of the user's code whose call opens a scope: not a generator (its frame
  is left at each ``yield``), an ``__enter__`` or ``__exit__`` (which may open a scope
  that outlives it), a module body or a comprehension (part of the function around it)."""
  if code.co_flags & _SKIPPED or code.co_name in ("__enter__", "__exit__"):
    return False
  if code.co_name.startswith("<") and code.co_name != "<lambda>":
    return False
  name = code.co_filename
  if name.startswith("<frozen "):  # the import system
    return False
  if name.startswith(_STDLIB) and not name.startswith(_SITE):
    return False
  return _is_user_code(code)
