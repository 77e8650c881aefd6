"""Reading one log file as it grows: JSON lines, and TensorBoard event files.

Each :meth:`~JsonlTail.read` takes only what was appended since the last one:
the file's offset and identity (device, inode and the bytes just before the
offset) are kept, a half-written last line or record waits for the next read,
and a file truncated or replaced starts over. Event files are read with
TensorBoard's event-file loader; a corrupt record stops it, and the records
after it are lost (reported once, with the byte offset).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from optax_dls._util import optional as _optional

Rows = list[dict[str, Any]]

_MARK = 32  # bytes before the offset that must not change while a file only grows
_RECORD_FRAMING = 16  # a TFRecord's length, length CRC and data CRC


def check_path(name: str, value: Any) -> str:
  """``value`` as a str path.

  Raises:
    TypeError: naming ``name``, unless ``value`` is a ``str`` or ``os.PathLike``.
  """
  if not isinstance(value, (str, os.PathLike)):
    raise TypeError(
      f"{name} must be a str or os.PathLike, got {value!r} of type {type(value).__name__}."
    )
  return os.fspath(value)


def reporter(name: str, callback: Any) -> Callable[[int, str], Any]:
  """``callback``, or a no-op for None.

  Raises:
    TypeError: naming ``name``, unless ``callback`` is callable or None.
  """
  if callback is None:
    return lambda where, why: None
  if not callable(callback):
    raise TypeError(
      f"{name} must be callable or None, got {callback!r} of type {type(callback).__name__}."
    )
  return callback


class Chunk(NamedTuple):
  """What one read of a file brought: the new ``rows``, the ``bad`` ``(where, why)`` (line
  numbers for JSON lines, byte offsets for event files), and whether the file had been
  truncated or replaced, so that the rows read before are void (``restarted``)."""

  rows: Rows
  bad: list[tuple[int, str]]
  restarted: bool


class _Position:
  """How far a file was read, and the identity that tells a grown file from a new one."""

  def __init__(self) -> None:
    self.identity: tuple[int, int] | None = None
    self.offset = 0
    self.size = 0
    self.mark = b""

  def moved(self, f: Any) -> bool:
    """Whether the open file ``f`` is no longer the one read so far (then starts over at 0)."""
    st = os.fstat(f.fileno())
    identity = (st.st_dev, st.st_ino)
    moved = self.identity is not None and (
      identity != self.identity or st.st_size < self.offset or not self._mark_holds(f)
    )
    if moved:
      self.offset, self.mark = 0, b""
    self.identity, self.size = identity, st.st_size
    return moved

  def _mark_holds(self, f: Any) -> bool:
    if not self.mark:
      return True
    f.seek(self.offset - len(self.mark))
    return f.read(len(self.mark)) == self.mark

  def advance(self, offset: int, f: Any) -> None:
    """Moves to ``offset``, remembering the bytes of ``f`` just before it."""
    self.offset = offset
    f.seek(max(offset - _MARK, 0))
    self.mark = f.read(offset - max(offset - _MARK, 0))


def _parse_line(text: bytes) -> tuple[dict[str, Any] | None, str | None]:
  """``(row, None)`` for a JSON object with a ``step`` key, ``(None, why)`` for a bad line,
  ``(None, None)`` for a blank one."""
  line = text.decode("utf-8", errors="replace").strip()  # undecodable bytes: a malformed line
  if not line:
    return None, None
  try:
    row = json.loads(line)
  except (ValueError, RecursionError) as e:  # JSONDecodeError, an over-long int, deep nesting
    return None, f"not JSON ({type(e).__name__})"
  if not (isinstance(row, dict) and "step" in row):
    return None, "not a JSON object with a 'step' key"
  return row, None


class JsonlTail:
  """A JSON-lines file read as it grows.

  Each :meth:`read` parses the lines completed since the last one; a last
  line without its newline waits (with ``final=True`` it is taken as it is).

  Args:
    path: the file.
  """

  def __init__(self, path: str) -> None:
    self.path = path
    self._pos = _Position()
    self._line = 0

  def read(self, final: bool = False) -> Chunk:
    """The rows of the lines completed since the last read (see :class:`Chunk`).

    Args:
      final: bool, also take a last line that has no newline. Default False.

    Raises:
      OSError: the file cannot be read.
    """
    with open(self.path, "rb") as f:
      restarted = self._pos.moved(f)
      if restarted:
        self._line = 0
      f.seek(self._pos.offset)
      data = f.read()
      end = len(data) if final else data.rfind(b"\n") + 1
      lines = data[:end].split(b"\n") if end else []
      if lines and not lines[-1]:
        lines.pop()  # after the last newline
      rows, bad = [], []
      for text in lines:
        self._line += 1
        row, why = _parse_line(text)
        if row is not None:
          rows.append(row)
        elif why is not None:
          bad.append((self._line, why))
      self._pos.advance(self._pos.offset + end, f)
    return Chunk(rows, bad, restarted)


def _event_loader() -> Any:
  return _optional.require(
    "tensorboard.backend.event_processing.event_file_loader", "reading TensorBoard event files"
  )


LEAVES_TAG = "nonfinite_leaves"  # the text summary naming a non-finite step's leaves
_TEXT_SUFFIX = "/text_summary"  # appended by tensorboardX's add_text


def _values(payload: bytes) -> tuple[int, dict[str, Any]] | None:
  """``(step, {tag: value})`` of one serialised ``Event``, or None when it is not an ``Event``.

  Values are the scalars (``simple_value`` or a one-element numeric tensor)
  and the leaf record: a text summary tagged ``nonfinite_leaves`` (or
  ``.../nonfinite_leaves``) holding a JSON object ``{leaf name: "inf" |
  "nan"}``, read back as that dict under the tag without tensorboardX's
  ``/text_summary`` suffix. Other summaries are ignored.
  """
  from google.protobuf.message import DecodeError
  from tensorboard.compat.proto import event_pb2
  from tensorboard.util import tensor_util

  try:
    event = event_pb2.Event.FromString(payload)
  except DecodeError:
    return None
  values: dict[str, Any] = {}
  for v in event.summary.value:
    if v.HasField("simple_value"):
      values[v.tag] = float(v.simple_value)
    elif v.HasField("tensor"):
      try:
        arr = np.asarray(tensor_util.make_ndarray(v.tensor))
      except (TypeError, ValueError):  # a dtype TensorBoard cannot turn into NumPy
        continue
      if arr.size == 1 and (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        values[v.tag] = float(arr.reshape(-1)[0])
      elif arr.size == 1 and arr.dtype == object:
        tag = v.tag.removesuffix(_TEXT_SUFFIX)
        named = tag == LEAVES_TAG or tag.endswith("/" + LEAVES_TAG)
        leaves = _leaf_record(arr.reshape(-1)[0]) if named else None
        if leaves is not None:
          values[tag] = leaves
  return int(event.step), values


def _leaf_record(text: Any) -> dict[str, str] | None:
  """``{leaf name: "inf" | "nan"}`` from the bytes of a leaf record, or None when they hold
  something else."""
  try:
    record = json.loads(text)
  except (TypeError, ValueError):
    return None
  if not isinstance(record, dict) or not all(v in ("inf", "nan") for v in record.values()):
    return None
  return record


class EventsTail:
  """A TensorBoard event file read as it grows, with TensorBoard's event-file loader.

  Each :meth:`read` takes the records completed since the last one; a record
  cut short by the end of the file waits for the rest. A corrupt record stops
  the loader there: the records after it are lost, and are reported once as
  ``(byte offset, why)`` (at once with ``final=True``; otherwise once the file
  has stopped growing with the record still unread).

  Args:
    path: the event file.

  Raises:
    MissingExtraError: ``tensorboard`` is not installed.
  """

  def __init__(self, path: str) -> None:
    self.path = path
    self._module = _event_loader()
    self._loader: Any = None
    self._pos = _Position()
    self._stuck: tuple[int, int] | None = None
    self._reported: int | None = None

  def read(self, final: bool = False) -> Chunk:
    """The scalars and leaf records of the records completed since the last read, one row per
    step.

    Args:
      final: bool, report unread bytes at the end of the file at once. Default False.

    Raises:
      OSError: the file cannot be read.
    """
    with open(self.path, "rb") as f:  # an OSError here rather than inside the loader
      restarted = self._pos.moved(f)
      if restarted or self._loader is None:
        self._loader = self._module.RawEventFileLoader(self.path)
        self._stuck = self._reported = None
      by_step: dict[int, dict[str, Any]] = {}
      bad = []
      offset = self._pos.offset
      for payload in self._loader.Load():
        parsed = _values(payload)
        if parsed is None:
          bad.append((offset, "not an Event protobuf"))
        elif parsed[1]:
          by_step.setdefault(parsed[0], {"step": parsed[0]}).update(parsed[1])
        offset += _RECORD_FRAMING + len(payload)
      self._pos.advance(offset, f)
    bad.extend(self._unread(final))
    return Chunk([by_step[s] for s in sorted(by_step)], bad, restarted)

  def _unread(self, final: bool) -> list[tuple[int, str]]:
    """The report of bytes the loader stopped before, once per offset."""
    offset, size = self._pos.offset, self._pos.size
    stuck, self._stuck = self._stuck, (offset, size)
    if offset >= size or self._reported == offset or not (final or stuck == (offset, size)):
      return []
    self._reported = offset
    why = f"a corrupt or cut-short record: the {size - offset} byte(s) from there to the end"
    return [(offset, why + " are not read")]
