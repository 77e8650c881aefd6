"""``optax-dls inspect --follow``: each run's step, scale, skips (also over the last :data:`RECENT`
updates), last non-finite step and diagnoses; redrawn on a terminal, else a line per change."""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from optax_dls._logs import diagnosis as _diagnosis
from optax_dls._logs import read as _read
from optax_dls._logs import report as _report

RECENT = 100  # updates of the "recent" skips and update ratio
_UP_AND_CLEAR = "\x1b[{}F\x1b[J"  # cursor up N lines to their start, clear to the end of screen


def _run_status(name: str, entry: dict[str, Any], rows: _read.Rows, block: bool) -> list[str]:
  """One run: on a terminal (``block``) a head line and indented lines, else one line."""
  s = entry["summary"]
  scales = [r["loss_scale"] for r in rows if isinstance(r.get("loss_scale"), (int, float))]
  scale = _diagnosis.scale_text(float(scales[-1])) if scales else "unknown"
  skips = f"skips {'unknown' if s['skips'] is None else s['skips']} "
  skips += f"(update ratio {_report.or_unknown(s['update_ratio'], '{:.4f}')})"
  recent = _diagnosis.recent(rows, RECENT)
  recent_text = "recent unknown" if recent is None else (
    f"last {recent['updates']} updates: {recent['skips']} skipped "
    f"({recent['update_ratio']:.4f})"
  )  # fmt: skip
  last = _report.last_nonfinite(s, shown=3)
  last_text = [f"last non-finite {last}"] if last else []
  gap = "  " if block else " "
  head = f"run {name}{gap}step {s['last_step']}{gap}loss scale {scale}"
  if block:
    lines = [head, f"  {skips}, {recent_text}", *(f"  {t}" for t in last_text)]
    return lines + [f"  ! {d['symptom']}" for d in entry["diagnosis"]]
  diagnoses = "; ".join(d["symptom"].split(":", 1)[0] for d in entry["diagnosis"])
  return [" | ".join([head, skips, recent_text, *last_text] + [f"! {diagnoses}"] * bool(diagnoses))]


class Follower:
  """The logs under a run folder (it need not exist yet) and the warnings already shown."""

  def __init__(self, run_dir: str) -> None:
    self.logs = _read.LogSet(run_dir)
    self._missing: str | None = None

  def refresh(self, block: bool) -> tuple[list[str], list[str]]:
    """``(status lines, new warnings)``: the status as a terminal block, else a line per run."""
    warnings = [f"{path}: {what}" for path, what in self.logs.poll()]
    missing = self.logs.missing_warning()
    if missing and missing != self._missing:
      warnings.append(f"{self.logs.run_dir}: {missing}")
    self._missing = missing
    runs = self.logs.runs()
    report = _report.build(runs)
    waiting = [n for n in self.logs.waiting() if n not in report]
    if not report and not waiting:
      return [f"waiting for logs under {self.logs.run_dir}"], warnings
    lines = [line for n, e in report.items() for line in _run_status(n, e, runs[n], block)]
    gap = "  " if block else " "
    return lines + [f"run {name}{gap}waiting (no rows yet)" for name in waiting], warnings


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
  run_dir: str,
  interval: float = 2.0,
  *,
  refreshes: int | None = None,
  out: TextIO | None = None,
  err: TextIO | None = None,
) -> int:
  """Shows every run under ``run_dir`` every ``interval`` s until Ctrl-C (or ``refreshes``); 0."""
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
  """Ctrl-C raises ``KeyboardInterrupt`` in the block, also where SIGINT was ignored."""
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
