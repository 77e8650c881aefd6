"""Finding and reading a run folder's metrics logs: JSON lines and TensorBoard event files.

Bad lines, corrupt records, malformed rows and unreadable files are skipped,
each on its own, and counted in a warning on stderr.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np

from optax_dls import writers

KEYS = (
  "loss_scale",
  "skipped",
  "skip_count",
  "consecutive_skips",
  "num_steps",
  "update_ratio",
  "grad_norm",
  "fp32_fallback",
  "loss",
)
_SHOWN = 5  # line numbers / offsets listed in a warning


class NoLogsError(Exception):
  """No metrics logs under the run folder."""


def _canonical(key: str) -> str:
  """Maps tags such as ``train/loss_scale`` or ``optax_dls/underflow/zero_frac`` to our keys."""
  if "underflow/" in key:
    return key[key.index("underflow/") :]
  for k in KEYS:
    if key == k or key.endswith("/" + k):
      return k
  return key


def _train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rows with loss-scale metrics (e.g. not validation rows), or all if none has them."""
  kept = [r for r in rows if "loss_scale" in r or "skipped" in r]
  return kept or rows


def _merge_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per step, sorted by step; a step logged twice keeps the later values."""
  by_step: dict[int, dict[str, Any]] = {}
  for row in rows:
    by_step.setdefault(row["step"], {}).update(row)
  return [by_step[s] for s in sorted(by_step)]


def _step(value: Any) -> int | None:
  """A row's step as an int, or None when it is not a whole finite number (a malformed row)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
    return None
  return int(value) if abs(value) < 2**63 else None


def _warn(path: str, what: str) -> None:
  print(f"optax-dls inspect: warning: {path}: {what}", file=sys.stderr)


def _listing(where: list[int], unit: str) -> str:
  shown = ", ".join(str(w) for w in where[:_SHOWN])
  return f"{unit} {shown}{', ...' if len(where) > _SHOWN else ''}"


def _read(path: str, kind: str) -> list[dict[str, Any]]:
  """The well-formed rows of one log file (``kind`` "jsonl" or "events"); warns about the rest."""
  bad: list[int] = []
  try:
    if kind == "jsonl":
      raw = writers.read_jsonl(path, on_bad_line=lambda line, why: bad.append(line))
    else:
      raw = writers.read_tensorboard(path, on_bad_record=lambda offset, why: bad.append(offset))
  except Exception as e:  # noqa: BLE001  (OSError, or anything a foreign file may raise)
    _warn(path, f"unreadable ({type(e).__name__}: {e})")
    return []
  if bad and kind == "jsonl":
    _warn(
      path,
      f"skipped {len(bad)} line(s) that are not JSON objects with a 'step' "
      f"({_listing(bad, 'line')})",
    )
  elif bad:
    _warn(path, f"skipped {len(bad)} corrupt record(s) ({_listing(bad, 'at byte')})")
  rows, malformed = [], 0
  for row in raw:
    step = _step(row.get("step"))
    if step is None:
      malformed += 1
      continue
    rows.append({**row, "step": step})
  if malformed:
    _warn(path, f"skipped {malformed} row(s) whose 'step' is not a whole number")
  return rows


def _log_files(run_dir: str) -> list[tuple[str, str]]:
  """``[(path, kind)]``: per folder under ``run_dir``, its JSONL files, or its event files if it
  has none."""
  found = []
  for root, _, files in sorted(os.walk(run_dir)):
    jsonl = [n for n in files if n.endswith(".jsonl")]
    events = [n for n in files if n.startswith("events.out.tfevents")]
    kind, names = ("jsonl", jsonl) if jsonl else ("events", events)
    found.extend((os.path.join(root, n), kind) for n in sorted(names))
  return found


def _same_float32(a: Any, b: Any) -> bool:
  """Whether ``a`` and ``b`` are numbers equal in float32 (as TensorBoard stores them)."""
  if not all(isinstance(x, (int, float)) for x in (a, b)):
    return False
  with np.errstate(over="ignore"):
    try:
      return bool(np.float32(float(a)) == np.float32(float(b)))
    except OverflowError:
      return False


def _is_metric(key: str) -> bool:
  """Whether ``key`` is one of the loss scaler's metrics (not, e.g., a wall time logged apart)."""
  return key in KEYS or key.startswith(("underflow/", "overflows/"))


def _is_copy(events_rows: list[dict[str, Any]], jsonl_rows: list[dict[str, Any]]) -> bool:
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
        if not _same_float32(value, other[key]):
          return False
        compared += 1
  return compared > 0


def _drop_copies(runs: dict[str, list[dict[str, Any]]], from_events: set[str]) -> None:
  """Drops from ``runs`` each run read from event files that is a copy of a run read from JSONL."""
  from_jsonl = [rows for name, rows in runs.items() if name not in from_events]
  for name in from_events:
    if name in runs and any(_is_copy(runs[name], rows) for rows in from_jsonl):
      del runs[name]


def load_runs(run_dir: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
  """``{run name: rows sorted by step}`` from the logs under ``run_dir``.

  Each folder is read from its JSONL files, or, where it has none, from its
  TensorBoard event files. A run is named by the rows' ``run`` key (a
  string), else by its folder. A run read from event files whose every
  step a run read from JSON lines holds with the same metrics (float32 as
  TensorBoard keeps them) is that run's TensorBoard copy, and left out.
  Rows without loss-scale keys (validation rows) are dropped when a run has
  others; rows of one step are merged, the later values winning. Bad lines,
  corrupt records, malformed rows and unreadable files are skipped with a
  warning on stderr.

  Raises:
    NoLogsError: ``run_dir`` is missing, holds no logs, or only unreadable ones.
    TypeError: ``run_dir`` is not a str or ``os.PathLike``.
  """
  run_dir = writers._check_path("run_dir", run_dir)
  if not os.path.isdir(run_dir):
    raise NoLogsError(f"{run_dir!r} is not a folder.")
  files = _log_files(run_dir)
  runs: dict[str, list[dict[str, Any]]] = {}
  from_events = set()
  top = os.path.basename(os.path.abspath(run_dir))
  for path, kind in files:
    folder = os.path.relpath(os.path.dirname(path), run_dir)
    for row in _read(path, kind):
      row = {_canonical(k): v for k, v in row.items()}
      name = row.get("run")
      name = name if isinstance(name, str) else (folder if folder != "." else top)
      runs.setdefault(name, []).append(row)
      if kind == "events":
        from_events.add(name)
  runs = {k: _merge_steps(_train_rows(v)) for k, v in runs.items() if v}
  _drop_copies(runs, from_events)
  if not runs and files:
    raise NoLogsError(
      f"the logs under {run_dir!r} exist but are unreadable: none of {len(files)} file(s) "
      f"({', '.join(p for p, _ in files[:3])}{', ...' if len(files) > 3 else ''}) holds a row "
      "with a whole-number 'step'."
    )
  if not runs:
    raise NoLogsError(
      f"no metrics logs under {run_dir!r}: expected *.jsonl files with a 'step' key "
      "(optax_dls.writers.MetricsWriter) or TensorBoard event files (events.out.tfevents.*)."
    )
  return runs
