"""Reading a run folder's ``*.jsonl`` or TensorBoard logs, once or as they grow: a half-written
end waits, a file truncated or replaced starts over, bad parts are skipped with a warning."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import numpy as np

from optax_dls._util import optional as _optional

Rows = list[dict[str, Any]]
Bad = list[tuple[int, str]]  # (line number or byte offset, why)

KEYS = (
  *("loss_scale", "skipped", "skip_count", "consecutive_skips", "num_steps", "update_ratio"),
  *("grad_norm", "fp32_fallback", "recomputed_steps", "recompute_tries", "skips_at_min_scale"),
  *("nonfinite_step", "nonfinite_loss", "nonfinite_leaves", "nonfinite_leaf_count", "loss"),
)
_PREFIXES = ("underflow/", "overflows/")  # per-group keys, kept whole
LEAVES_TAG = "nonfinite_leaves"  # the text summary naming a non-finite step's leaves
LOCATE_NAME = "locate.json"  # a saved optax_dls.locate report
SHOWN = 5  # items listed in a warning or a report
_MARK = 32  # bytes before the offset that must not change while a file only grows
_FRAMING = 16  # a TFRecord's length, length CRC and data CRC


def whole(value: Any) -> int | None:
  """``value`` as an int when a whole finite number (not a bool) below 2**63 in size."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
    return None
  return int(value) if abs(value) < 2**63 else None


class NoLogsError(Exception):
  """No metrics logs under the run folder."""


def check_path(name: str, value: Any) -> str:
  """``value`` as a str path; TypeError naming ``name`` unless a ``str`` or ``os.PathLike``."""
  if not isinstance(value, (str, os.PathLike)):
    raise TypeError(
      f"{name} must be a str or os.PathLike, got {value!r} of type {type(value).__name__}."
    )
  return os.fspath(value)


def canonical(key: str) -> str:
  """Maps tags such as ``train/loss_scale`` or ``optax_dls/underflow/zero_frac`` to our keys."""
  for prefix in _PREFIXES:
    if prefix in key:
      return key[key.index(prefix) :]
  return next((k for k in KEYS if key == k or key.endswith("/" + k)), key)


def _parse_line(text: bytes) -> tuple[dict[str, Any] | None, str | None]:
  """``(row, None)``, ``(None, why)`` for a bad line, ``(None, None)`` for a blank one."""
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


def _event_values(payload: bytes) -> tuple[int, dict[str, Any]] | None:
  """``(step, {tag: value})`` of a serialised ``Event``, None when not one."""
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
      continue
    try:
      arr = np.asarray(tensor_util.make_ndarray(v.tensor)).reshape(-1)
    except (TypeError, ValueError):  # no tensor, or a dtype TensorBoard cannot turn into NumPy
      continue
    if arr.size == 1 and (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
      values[v.tag] = float(arr[0])
    elif arr.size == 1 and arr.dtype == object:
      tag = v.tag.removesuffix("/text_summary")  # as tensorboardX tags text
      if (tag == LEAVES_TAG or tag.endswith("/" + LEAVES_TAG)) and (leaves := _leaves(arr[0])):
        values[tag] = leaves
  return int(event.step), values


def _leaves(text: Any) -> dict[str, str] | None:
  """``{leaf name: "inf" | "nan"}`` from a leaf record's bytes, or None for anything else."""
  try:
    record = json.loads(text)
  except (TypeError, ValueError):
    return None
  ok = isinstance(record, dict) and all(v in ("inf", "nan") for v in record.values())
  return record if ok else None


class LogFile:
  """A ``"jsonl"`` or ``"events"`` log file, read as it grows into :attr:`rows` by :meth:`poll`."""

  def __init__(self, path: str, kind: str) -> None:
    self.path, self.kind = path, kind
    self.rows: Rows = []
    self._identity: tuple[int, int] | None = None
    self._offset = self._size = self._line = 0
    self._mark = b""
    self._loader: Any = None
    self._stuck: tuple[int, int] | None = None
    self._reported: int | None = None
    self._error: str | None = None

  def read(self, final: bool = False) -> tuple[Rows, Bad, bool]:
    """``(new rows, bad parts, restarted)``; ``final`` also takes a last line without newline."""
    module = None
    if self.kind == "events":
      what = "reading TensorBoard event files"
      module = _optional.require("tensorboard.backend.event_processing.event_file_loader", what)
    with open(self.path, "rb") as f:
      st = os.fstat(f.fileno())
      f.seek(max(self._offset - len(self._mark), 0))
      restarted = self._identity is not None and (
        (st.st_dev, st.st_ino) != self._identity
        or st.st_size < self._offset
        or f.read(len(self._mark)) != self._mark
      )
      if restarted:
        self._offset, self._mark, self._line, self._loader = 0, b"", 0, None
      self._identity, self._size = (st.st_dev, st.st_ino), st.st_size
      rows, bad, end = self._jsonl(f, final) if module is None else self._events(module)
      self._offset = end
      f.seek(max(end - _MARK, 0))
      self._mark = f.read(end - max(end - _MARK, 0))
    return rows, bad + (self._unread(final) if module else []), restarted

  def _jsonl(self, f: Any, final: bool) -> tuple[Rows, Bad, int]:
    f.seek(self._offset)
    data = f.read()
    end = len(data) if final else data.rfind(b"\n") + 1
    rows, bad = [], []
    for text in data[:end].removesuffix(b"\n").split(b"\n") if end else []:
      self._line += 1
      row, why = _parse_line(text)
      if row is not None:
        rows.append(row)
      elif why is not None:
        bad.append((self._line, why))
    return rows, bad, self._offset + end

  def _events(self, module: Any) -> tuple[Rows, Bad, int]:
    if self._loader is None:
      self._loader = module.RawEventFileLoader(self.path)
      self._stuck = self._reported = None
    by_step: dict[int, dict[str, Any]] = {}
    bad, offset = [], self._offset
    for payload in self._loader.Load():
      parsed = _event_values(payload)
      if parsed is None:
        bad.append((offset, "not an Event protobuf"))
      elif parsed[1]:
        by_step.setdefault(parsed[0], {"step": parsed[0]}).update(parsed[1])
      offset += _FRAMING + len(payload)
    return [by_step[s] for s in sorted(by_step)], bad, offset

  def _unread(self, final: bool) -> Bad:
    """The bytes the loader stopped before, reported once per offset."""
    offset, size = self._offset, self._size
    stuck, self._stuck = self._stuck, (offset, size)
    if offset >= size or self._reported == offset or not (final or stuck == (offset, size)):
      return []
    self._reported = offset
    why = f"a corrupt or cut-short record: the {size - offset} byte(s) from there to the end"
    return [(offset, why + " are not read")]

  def poll(self, final: bool) -> list[str]:
    """Reads what the file gained into :attr:`rows`; returns its warnings (an error once)."""
    try:
      rows, bad, restarted = self.read(final)
    except _optional.MissingExtraError:
      raise
    except Exception as e:  # noqa: BLE001  (OSError, or anything a foreign file may raise)
      error = f"unreadable ({type(e).__name__}: {e})"
      new, self._error = error != self._error, error
      return [error] if new else []
    self._error = None
    self.rows = [] if restarted else self.rows
    warnings = [f"at byte {w}: {why}" for w, why in bad] if self.kind == "events" else []
    if bad and self.kind == "jsonl":
      lines = listed([w for w, _ in bad])
      warnings.append(
        f"skipped {len(bad)} line(s) that are not JSON objects with a 'step' (line {lines})"
      )
    steps = [whole(row.get("step")) for row in rows]
    self.rows += [
      {**{canonical(k): v for k, v in row.items()}, "step": step}
      for row, step in zip(rows, steps, strict=True)
      if step is not None
    ]
    if malformed := steps.count(None):
      warnings.append(f"skipped {malformed} row(s) whose 'step' is not a whole number")
    return warnings


def _merged(rows: Rows) -> Rows:
  """One row per step, the later winning; the rows with loss-scale metrics where some have them."""
  by_step: dict[int, dict[str, Any]] = {}
  for row in [r for r in rows if "loss_scale" in r or "skipped" in r] or rows:
    by_step.setdefault(row["step"], {}).update(row)
  return [by_step[s] for s in sorted(by_step)]


def _same(a: Any, b: Any) -> bool:
  """Numbers equal in float32 (as TensorBoard keeps them), or the same leaf record."""
  if isinstance(a, dict) or isinstance(b, dict):
    return a == b
  if not all(isinstance(x, (int, float)) for x in (a, b)):
    return False
  with np.errstate(over="ignore"):
    try:
      return bool(np.float32(float(a)) == np.float32(float(b)))
    except OverflowError:
      return False


def _is_copy(events_rows: Rows, jsonl_rows: Rows) -> bool:
  """Whether ``events_rows`` are a (perhaps lagging) copy of ``jsonl_rows``."""
  by_step = {r["step"]: r for r in jsonl_rows}
  compared = 0
  for row in events_rows:
    other = by_step.get(row["step"])
    if other is None:
      return False
    for key, value in row.items():
      if (key in KEYS or key.startswith(_PREFIXES)) and key in other:
        if not _same(value, other[key]):
          return False
        compared += 1
  return compared > 0


class LogSet:
  """The logs under a run folder (which may not exist yet), found again at each :meth:`poll`."""

  def __init__(self, run_dir: str) -> None:
    self.run_dir = run_dir
    self.files: dict[str, LogFile] = {}
    self.missing: _optional.MissingExtraError | None = None
    self.unread: list[str] = []

  def poll(self, final: bool = False) -> list[tuple[str, str]]:
    """Reads what the logs gained; returns the new ``(path, warning)``."""
    found: dict[str, str] = {}  # {path: kind}: per folder, its JSONL files, or its event files
    for root, _, files in sorted(os.walk(self.run_dir)):  # nothing when not a folder
      jsonl = [n for n in files if n.endswith(".jsonl")]
      events = [n for n in files if n.startswith("events.out.tfevents")]
      kind, names = ("jsonl", jsonl) if jsonl else ("events", events)
      found.update((os.path.join(root, n), kind) for n in sorted(names))
    self.files = {p: f for p, f in self.files.items() if found.get(p) == f.kind}
    warnings: list[tuple[str, str]] = []
    self.unread = []
    for path, kind in found.items():
      log = self.files.setdefault(path, LogFile(path, kind))
      try:
        warnings.extend((path, w) for w in log.poll(final))
      except _optional.MissingExtraError as e:
        self.missing = e
        self.unread.append(path)
    return warnings

  def missing_warning(self) -> str | None:
    """One line on the event files left unread for want of ``tensorboard``, or None."""
    if not self.unread:
      return None
    folders = sorted({self._name(p) for p in self.unread})
    shown = listed(folders)
    return f"the event files of {len(folders)} folder(s) are not read ({shown}): {self.missing}"

  def _name(self, path: str) -> str:
    folder = os.path.relpath(os.path.dirname(path), self.run_dir)
    return folder if folder != "." else os.path.basename(os.path.abspath(self.run_dir))

  def runs(self) -> dict[str, Rows]:
    """``{run name: rows}``, by the rows' ``run`` else by folder, a TensorBoard copy left out."""
    runs: dict[str, Rows] = {}
    from_events = set()
    for path, log in self.files.items():
      for row in log.rows:
        name = row["run"] if isinstance(row.get("run"), str) else self._name(path)
        runs.setdefault(name, []).append(row)
        if log.kind == "events":
          from_events.add(name)
    runs = {k: _merged(v) for k, v in runs.items()}
    from_jsonl = [rows for name, rows in runs.items() if name not in from_events]
    copies = {n for n in from_events if any(_is_copy(runs[n], rows) for rows in from_jsonl)}
    return {k: v for k, v in runs.items() if k not in copies}

  def waiting(self) -> list[str]:
    """The folders (as run names) whose log files hold no row yet."""
    with_rows = {self._name(p) for p, log in self.files.items() if log.rows}
    return sorted({self._name(p) for p in self.files} - with_rows)


def listed(items: list[Any], n: int = SHOWN) -> str:
  """The first ``n`` of ``items``, comma-separated, then ``", ..."`` when there are more."""
  return ", ".join(str(x) for x in items[:n]) + (", ..." if len(items) > n else "")


def warn(path: str, what: str) -> None:
  print(f"optax-dls inspect: warning: {path}: {what}", file=sys.stderr)


def load_runs(run_dir: str | os.PathLike) -> dict[str, Rows]:
  """:meth:`LogSet.runs` of the logs under ``run_dir``, read once; NoLogsError without any."""
  run_dir = check_path("run_dir", run_dir)
  if not os.path.isdir(run_dir):
    raise NoLogsError(f"{run_dir!r} is not a folder.")
  logs = LogSet(run_dir)
  for path, what in logs.poll(final=True):
    warn(path, what)
  runs = logs.runs()
  if logs.missing is not None and not runs:
    raise logs.missing
  if note := logs.missing_warning():
    warn(run_dir, note)
  files = list(logs.files)
  if not runs and files:
    raise NoLogsError(
      f"the logs under {run_dir!r} exist but are unreadable: none of {len(files)} file(s) "
      f"({listed(files, 3)}) holds a row with a whole-number 'step'."
    )
  if not runs:
    raise NoLogsError(
      f"no metrics logs under {run_dir!r}: expected *.jsonl files with a 'step' key "
      "(optax_dls.writers.MetricsWriter) or TensorBoard event files (events.out.tfevents.*)."
    )
  return runs
