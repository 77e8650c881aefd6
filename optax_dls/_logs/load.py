"""Finding and reading a run folder's metrics logs, once or as they grow.

The logs are the ``*.jsonl`` files of :class:`optax_dls.writers.MetricsWriter`
(or any JSON lines with a ``step`` key) and TensorBoard event files, read with
TensorBoard's own event-file loader. Each folder under the run folder is read
from its JSONL files, or, where it has none, from its event files.

Every file is read incrementally (:mod:`optax_dls._logs.tail`): a later read takes
only what was appended. :func:`load_runs` reads a folder once,
:class:`LogSet` again and again (``optax-dls inspect --follow``).

Bad lines, rows whose ``step`` is not a whole number, undecodable records and
unreadable files are skipped, each on its own, and reported as warnings. A
corrupt TensorBoard record stops TensorBoard's loader: the records before it
are kept, the rest of that file is lost, and the warning says from which byte.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from optax_dls._logs.tail import EventsTail, JsonlTail, check_path
from optax_dls._util import optional as _optional

Rows = list[dict[str, Any]]

KEYS = (
  "loss_scale",
  "skipped",
  "skip_count",
  "consecutive_skips",
  "num_steps",
  "update_ratio",
  "grad_norm",
  "fp32_fallback",
  "recomputed_steps",
  "recompute_tries",
  "skips_at_min_scale",
  "nonfinite_step",
  "nonfinite_loss",
  "nonfinite_leaves",
  "nonfinite_leaf_count",
  "loss",
)
_PREFIXES = ("underflow/", "overflows/")  # per-group keys, kept whole
_SHOWN = 5  # line numbers / offsets listed in a warning


class NoLogsError(Exception):
  """No metrics logs under the run folder."""


def canonical(key: str) -> str:
  """Maps tags such as ``train/loss_scale`` or ``optax_dls/underflow/zero_frac`` to our keys."""
  for prefix in _PREFIXES:
    if prefix in key:
      return key[key.index(prefix) :]
  for k in KEYS:
    if key == k or key.endswith("/" + k):
      return k
  return key


def _is_metric(key: str) -> bool:
  """Whether ``key`` is one of the loss scaler's metrics (not, e.g., a wall time logged apart)."""
  return key in KEYS or key.startswith(_PREFIXES)


# --- One file's rows -----------------------------------------------------------------------------


def _step(value: Any) -> int | None:
  """A row's step as an int, or None when it is not a whole finite number (a malformed row)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
    return None
  return int(value) if abs(value) < 2**63 else None


def _listing(where: list[int], unit: str) -> str:
  shown = ", ".join(str(w) for w in where[:_SHOWN])
  return f"{unit} {shown}{', ...' if len(where) > _SHOWN else ''}"


class _LogFile:
  """One log file's well-formed rows, canonical keys, kept up to date by :meth:`poll`."""

  def __init__(self, path: str, kind: str) -> None:
    self.path, self.kind = path, kind
    self.tail: JsonlTail | EventsTail | None = None
    self.rows: Rows = []
    self._error: str | None = None

  def poll(self, final: bool) -> list[str]:
    """Reads what the file gained; returns the warnings about it (an error only once)."""
    try:
      if self.tail is None:
        self.tail = JsonlTail(self.path) if self.kind == "jsonl" else EventsTail(self.path)
      chunk = self.tail.read(final)
    except _optional.MissingExtraError:
      raise
    except Exception as e:  # noqa: BLE001  (OSError, or anything a foreign file may raise)
      error = f"unreadable ({type(e).__name__}: {e})"
      new, self._error = error != self._error, error
      return [error] if new else []
    self._error = None
    if chunk.restarted:
      self.rows = []
    return self._bad_warnings(chunk.bad) + self._add(chunk.rows)

  def _bad_warnings(self, bad: list[tuple[int, str]]) -> list[str]:
    if not bad:
      return []
    if self.kind == "jsonl":
      where = _listing([w for w, _ in bad], "line")
      return [f"skipped {len(bad)} line(s) that are not JSON objects with a 'step' ({where})"]
    return [f"at byte {w}: {why}" for w, why in bad]

  def _add(self, rows: Rows) -> list[str]:
    malformed = 0
    for row in rows:
      step = _step(row.get("step"))
      if step is None:
        malformed += 1
        continue
      self.rows.append({**{canonical(k): v for k, v in row.items()}, "step": step})
    return [f"skipped {malformed} row(s) whose 'step' is not a whole number"] if malformed else []


# --- A folder of runs ----------------------------------------------------------------------------


def find_logs(run_dir: str) -> list[tuple[str, str]]:
  """``[(path, kind)]``, kind ``"jsonl"`` or ``"events"``: per folder under ``run_dir``, its JSONL
  files, or its event files if it has none."""
  found: list[tuple[str, str]] = []
  for root, _, files in sorted(os.walk(run_dir)):
    jsonl = [n for n in files if n.endswith(".jsonl")]
    events = [n for n in files if n.startswith("events.out.tfevents")]
    kind, names = ("jsonl", jsonl) if jsonl else ("events", events)
    found.extend((os.path.join(root, n), kind) for n in sorted(names))
  return found


def _train_rows(rows: Rows) -> Rows:
  """The rows with loss-scale metrics (e.g. not validation rows), or all if none has them."""
  kept = [r for r in rows if "loss_scale" in r or "skipped" in r]
  return kept or rows


def _merge_steps(rows: Rows) -> Rows:
  """One row per step, sorted by step; a step logged twice keeps the later values."""
  by_step: dict[int, dict[str, Any]] = {}
  for row in rows:
    by_step.setdefault(row["step"], {}).update(row)
  return [by_step[s] for s in sorted(by_step)]


def _same_value(a: Any, b: Any) -> bool:
  """Whether ``a`` and ``b`` are numbers equal in float32 (as TensorBoard stores them), or
  the same leaf record (``{name: "inf" | "nan"}``, a dict in both logs)."""
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
  """Whether every step of ``events_rows`` is in ``jsonl_rows`` with the same metrics (the same
  run logged to both, the TensorBoard copy perhaps behind), at least one value compared."""
  by_step = {r["step"]: r for r in jsonl_rows}
  compared = 0
  for row in events_rows:
    other = by_step.get(row["step"])
    if other is None:
      return False
    for key, value in row.items():
      if _is_metric(key) and key in other:
        if not _same_value(value, other[key]):
          return False
        compared += 1
  return compared > 0


def _drop_copies(runs: dict[str, Rows], from_events: set[str]) -> None:
  """Drops from ``runs`` each run read from event files that is a copy of a run read from JSONL."""
  from_jsonl = [rows for name, rows in runs.items() if name not in from_events]
  for name in from_events:
    if name in runs and any(_is_copy(runs[name], rows) for rows in from_jsonl):
      del runs[name]


class LogSet:
  """The logs under a run folder, read again at each :meth:`poll`.

  Each poll looks for new files and folders, reads what every file gained,
  and starts over a file that was truncated or replaced; a file that is gone
  takes its rows with it. :meth:`runs` groups the rows by run. Without
  ``tensorboard`` the event files are left unread: ``missing`` holds the
  error and ``unread`` their paths.

  Args:
    run_dir: the folder (it need not exist yet).
  """

  def __init__(self, run_dir: str) -> None:
    self.run_dir = run_dir
    self.files: dict[str, _LogFile] = {}
    self.missing: _optional.MissingExtraError | None = None
    self.unread: list[str] = []

  def poll(self, final: bool = False) -> list[tuple[str, str]]:
    """Reads what the logs gained; returns the new ``(path, warning)``.

    Args:
      final: bool, read each file to its very end: a last line without its
        newline is taken as it is, unread bytes of an event file reported.
    """
    found = dict(find_logs(self.run_dir)) if os.path.isdir(self.run_dir) else {}
    for path in [p for p in self.files if found.get(p) != self.files[p].kind]:
      del self.files[path]
    warnings: list[tuple[str, str]] = []
    self.unread = []
    for path, kind in found.items():
      log = self.files.setdefault(path, _LogFile(path, kind))
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
    shown = ", ".join(folders[:_SHOWN]) + (", ..." if len(folders) > _SHOWN else "")
    return f"the event files of {len(folders)} folder(s) are not read ({shown}): {self.missing}"

  def _name(self, path: str) -> str:
    folder = os.path.relpath(os.path.dirname(path), self.run_dir)
    return folder if folder != "." else os.path.basename(os.path.abspath(self.run_dir))

  def runs(self) -> dict[str, Rows]:
    """``{run name: rows sorted by step}``: a run is named by its rows' ``run`` key (a string),
    else by its folder. Rows without loss-scale keys (validation rows) are dropped where a run
    has others; rows of one step are merged, the later values winning; a run read from event
    files that is a copy of one read from JSON lines is left out."""
    runs: dict[str, Rows] = {}
    from_events = set()
    for path, log in self.files.items():
      folder = self._name(path)
      for row in log.rows:
        name = row.get("run")
        name = name if isinstance(name, str) else folder
        runs.setdefault(name, []).append(row)
        if log.kind == "events":
          from_events.add(name)
    runs = {k: _merge_steps(_train_rows(v)) for k, v in runs.items()}
    _drop_copies(runs, from_events)
    return runs

  def waiting(self) -> list[str]:
    """The folders (as run names) whose log files hold no row yet."""
    with_rows = {self._name(p) for p, log in self.files.items() if log.rows}
    return sorted({self._name(p) for p in self.files} - with_rows)


def warn(path: str, what: str) -> None:
  """Prints ``what`` about ``path`` as a warning of ``optax-dls inspect`` on stderr."""
  import sys

  print(f"optax-dls inspect: warning: {path}: {what}", file=sys.stderr)


def load_runs(run_dir: str | os.PathLike) -> dict[str, Rows]:
  """``{run name: rows sorted by step}`` from the logs under ``run_dir``, read once.

  Each folder is read from its JSONL files, or, where it has none, from its
  TensorBoard event files. A run is named by the rows' ``run`` key (a
  string), else by its folder. A run read from event files whose every
  step a run read from JSON lines holds with the same metrics (float32 as
  TensorBoard keeps them, and the same named non-finite leaves) is that run's
  TensorBoard copy, and left out.
  Rows without loss-scale keys (validation rows) are dropped when a run has
  others; rows of one step are merged, the later values winning. Bad lines,
  corrupt records, malformed rows and unreadable files are skipped with a
  warning on stderr.

  Args:
    run_dir: the folder, searched recursively.

  Raises:
    NoLogsError: ``run_dir`` is missing, holds no logs, or only unreadable ones.
    TypeError: ``run_dir`` is not a str or ``os.PathLike``.
    MissingExtraError: event files to read, no ``tensorboard``, and no run
      read from JSON lines (with some, a warning names the files left unread).
  """
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
      f"({', '.join(files[:3])}{', ...' if len(files) > 3 else ''}) holds a row "
      "with a whole-number 'step'."
    )
  if not runs:
    raise NoLogsError(
      f"no metrics logs under {run_dir!r}: expected *.jsonl files with a 'step' key "
      "(optax_dls.writers.MetricsWriter) or TensorBoard event files (events.out.tfevents.*)."
    )
  return runs
