"""``optax-dls inspect RUN_DIR --follow``: the current state of every run, while the runs go on.

Each refresh reads what the logs gained (:class:`optax_dls._logs.load.LogSet`),
and builds the same summary and diagnosis as ``optax-dls inspect``
(:func:`optax_dls._logs.report.build`), of which it shows per run: the step, the
loss scale, the skips and update ratio, overall and over the last
:data:`RECENT` updates, the leaves of the last non-finite step, and the
current diagnoses. On a terminal the status block is redrawn in place; to a
file or a pipe each refresh writes one line per run.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from optax_dls._logs import load as _logs
from optax_dls._logs import report as _report
from optax_dls._logs import summary as _summary
from optax_dls._logs import tail as _tail

RECENT = 100  # updates of the "recent" skips and update ratio
_UP_AND_CLEAR = "\x1b[{}F\x1b[J"  # cursor up N lines to their start, clear to the end of screen


def _headline(symptom: str) -> str:
  return symptom.split(":", 1)[0]


def _ratio(value: float | None) -> str:
  return "unknown" if value is None else f"{value:.4f}"


def _scale(rows: _logs.Rows) -> str:
  scales = [r["loss_scale"] for r in rows if isinstance(r.get("loss_scale"), (int, float))]
  return _summary.scale_text(float(scales[-1])) if scales else "unknown"


def _fields(entry: dict[str, Any], rows: _logs.Rows) -> dict[str, str]:
  """The status of one run as short texts: step, scale, skips, recent, last, diagnoses."""
  s = entry["summary"]
  recent = _summary.recent(rows, RECENT)
  skips = "unknown" if s["skips"] is None else str(s["skips"])
  return {
    "step": str(s["last_step"]),
    "scale": _scale(rows),
    "skips": f"skips {skips} (update ratio {_ratio(s['update_ratio'])})",
    "recent": "recent unknown"
    if recent is None
    else f"last {recent['updates']} updates: {recent['skips']} skipped "
    f"({_ratio(recent['update_ratio'])})",
    "last": _report.last_nonfinite(s, shown=3) or "",
    "diagnoses": "; ".join(_headline(d["symptom"]) for d in entry["diagnosis"]),
  }


def _block_run(head: str, f: dict[str, str], entry: dict[str, Any]) -> list[str]:
  """One run in the terminal view: its head line, then indented lines."""
  lines = [head, f"  {f['skips']}, {f['recent']}"]
  if f["last"]:
    lines.append(f"  last non-finite {f['last']}")
  lines.extend(f"  ! {d['symptom']}" for d in entry["diagnosis"])
  return lines


def _line_run(head: str, f: dict[str, str], entry: dict[str, Any]) -> list[str]:
  """One run in the file or pipe view: one line of parts joined by ``" | "``."""
  parts = [head, f["skips"], f["recent"]]
  parts += [f"last non-finite {f['last']}"] if f["last"] else []
  parts += [f"! {f['diagnoses']}"] if f["diagnoses"] else []
  return [" | ".join(parts)]


def _status(
  report: dict[str, Any],
  runs: dict[str, _logs.Rows],
  waiting: list[str],
  gap: str,
  one_run: Callable[[str, dict[str, str], dict[str, Any]], list[str]],
) -> list[str]:
  """The status of every run, each as ``one_run`` writes it, then the runs still waiting.

  Args:
    report: run name -> its entry of :func:`optax_dls._logs.report.build`.
    runs: run name -> its rows.
    waiting: the names of the runs without rows yet (those in ``report`` are left out).
    gap: the space between the words of a run's head line (``"  "`` or ``" "``).
    one_run: ``(head line, the run's :func:`_fields`, its entry) -> lines``.
  """
  lines = []
  for name, entry in report.items():
    f = _fields(entry, runs[name])
    lines.extend(one_run(f"run {name}{gap}step {f['step']}{gap}loss scale {f['scale']}", f, entry))
  lines.extend(f"run {name}{gap}waiting (no rows yet)" for name in waiting if name not in report)
  return lines


def status_block(
  report: dict[str, Any], runs: dict[str, _logs.Rows], waiting: list[str]
) -> list[str]:
  """The status of every run as a few lines each (the terminal view)."""
  return _status(report, runs, waiting, "  ", _block_run)


def status_lines(
  report: dict[str, Any], runs: dict[str, _logs.Rows], waiting: list[str]
) -> list[str]:
  """The status of every run, one line each (the view written to a file or a pipe)."""
  return _status(report, runs, waiting, " ", _line_run)


class Follower:
  """The logs under a run folder and the warnings already shown, refreshed by :meth:`refresh`.

  Args:
    run_dir: the folder (it need not exist yet).
  """

  def __init__(self, run_dir: str) -> None:
    self.logs = _logs.LogSet(run_dir)
    self._missing: str | None = None

  def refresh(self, block: bool) -> tuple[list[str], list[str]]:
    """Reads what the logs gained; returns ``(status lines, new warnings)``.

    Args:
      block: bool, the terminal view (:func:`status_block`), else one line per
        run (:func:`status_lines`).
    """
    warnings = [f"{path}: {what}" for path, what in self.logs.poll()]
    missing = self.logs.missing_warning()
    if missing and missing != self._missing:
      warnings.append(f"{self.logs.run_dir}: {missing}")
    self._missing = missing
    runs = self.logs.runs()
    report = _report.build(runs)
    waiting = self.logs.waiting()
    if not report and not waiting:
      return [f"waiting for logs under {self.logs.run_dir}"], warnings
    view = status_block if block else status_lines
    return view(report, runs, waiting), warnings


class _Screen:
  """Writes each refresh: redrawn in place on a terminal, appended otherwise."""

  def __init__(self, out: TextIO, err: TextIO, tty: bool, interval: float) -> None:
    self.out, self.err, self.tty, self.interval = out, err, tty, interval
    self.drawn = 0  # lines of the block on screen, to move back over
    self.written: set[str] = set()  # the last refresh's lines (file or pipe view)

  def show(self, lines: list[str], warnings: list[str]) -> None:
    for w in warnings:
      self.err.write(f"optax-dls inspect: warning: {w}\n")
    if warnings:
      self.err.flush()
      self.drawn = 0  # the warnings stand below the old block: draw the new one below them
    if not self.tty:  # a line only where a run's status changed: a finished run stays quiet
      new = [line for line in lines if line not in self.written]
      self.written = set(lines)
      self.out.write("".join(f"{time.strftime('%H:%M:%S')} {line}\n" for line in new))
      self.out.flush()
      return
    width = shutil.get_terminal_size().columns
    header = f"{time.strftime('%H:%M:%S')}  every {self.interval:g} s, Ctrl-C to stop"
    block = [line if len(line) < width else line[: width - 4] + "..." for line in [header, *lines]]
    up = _UP_AND_CLEAR.format(self.drawn) if self.drawn else ""
    self.out.write(up + "".join(f"{line}\n" for line in block))
    self.out.flush()
    self.drawn = len(block)


def follow(
  run_dir: str | os.PathLike,
  interval: float = 2.0,
  *,
  refreshes: int | None = None,
  out: TextIO | None = None,
  err: TextIO | None = None,
) -> int:
  """Shows the state of every run under ``run_dir`` every ``interval`` seconds until Ctrl-C.

  Args:
    run_dir: the folder with the logs (searched recursively; it need not
      exist yet).
    interval: float > 0, seconds between two refreshes. Default 2.
    refreshes: optional int >= 1, stop after this many refreshes. Default
      None: until interrupted.
    out: the stream for the status; default ``sys.stdout``. A terminal
      (``isatty()``) gets the block redrawn in place, anything else a line
      per run each time that run's status changes (a finished run is not
      written again).
    err: the stream for warnings; default ``sys.stderr``.

  Returns:
    0, when stopped by Ctrl-C or after ``refreshes``.

  Raises:
    BrokenPipeError: the reader of the output went away.
    TypeError: ``run_dir`` is not a path, ``interval`` not a real number or
      ``refreshes`` not an int.
    ValueError: ``interval`` not finite and > 0, or ``refreshes`` < 1.
  """
  run_dir = _tail.check_path("run_dir", run_dir)
  _check_interval(interval, refreshes)
  out = sys.stdout if out is None else out
  err = sys.stderr if err is None else err
  follower = Follower(run_dir)
  screen = _Screen(out, err, bool(getattr(out, "isatty", lambda: False)()), interval)
  done = 0
  with _ctrl_c_interrupts():
    try:
      while True:
        screen.show(*follower.refresh(block=screen.tty))
        done += 1
        if refreshes is not None and done >= refreshes:
          return 0
        time.sleep(interval)
    except KeyboardInterrupt:
      return 0


@contextlib.contextmanager
def _ctrl_c_interrupts() -> Iterator[None]:
  """Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` inside the block, also in a process that
  was started with SIGINT ignored (a background job of a shell script, which Python then
  leaves ignored): otherwise nothing would end the live view. A handler of the program's
  own is kept; the previous one is restored after. Off the main thread, nothing changes."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  before = signal.getsignal(signal.SIGINT)
  if before in (signal.SIG_IGN, signal.SIG_DFL, None):
    signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    yield
  finally:
    if before is not None:  # None: a handler set outside Python, which stays
      signal.signal(signal.SIGINT, before)


def _check_interval(interval: Any, refreshes: Any) -> None:
  if isinstance(interval, bool) or not isinstance(interval, (int, float)):
    raise TypeError(f"interval must be a number of seconds, got {interval!r}.")
  if not (math.isfinite(interval) and interval > 0):
    raise ValueError(f"interval must be finite and > 0 seconds, got interval={interval!r}.")
  if refreshes is not None:
    if isinstance(refreshes, bool) or not isinstance(refreshes, int):
      raise TypeError(f"refreshes must be an int or None, got {refreshes!r}.")
    if refreshes < 1:
      raise ValueError(f"refreshes must be >= 1, got refreshes={refreshes!r}.")
