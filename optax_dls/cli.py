"""``optax-dls inspect RUN_DIR [--plot OUT.png | --json | --follow | --watch SECONDS]``:
summarise and diagnose a run's loss-scale logs, once or live.

Reads, per folder under ``RUN_DIR``, the ``*.jsonl`` files of
:class:`optax_dls.writers.MetricsWriter` (any JSON lines with a ``step``), else its TensorBoard
event files. Prints per run the steps, updates, skips, update ratio, longest skip streak, lowest /
median / highest scale and the steps at them, overflows per group and non-finite steps by
parameter, then each problem with what to do.
``--plot`` draws a panel per logged quantity; ``--json`` prints JSON; ``--follow`` (every 2 s) or
``--watch SECONDS`` shows each run's state until Ctrl-C. A problem is reported only where the rows
prove it (sparse logs through their counters); a missing column is unknown, without ``num_steps``
a step is an update, a step logged twice is merged. Bad lines, records and files are skipped with
a warning on stderr. Exit codes: :func:`main`."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from optax_dls._logs import live as _live
from optax_dls._logs import report as _report
from optax_dls._logs.read import NoLogsError
from optax_dls._util.optional import MissingExtraError

__all__ = ["main"]


def _closed_pipe() -> int:
  """Sends stdout to devnull, so the interpreter's final flush does not fail too; 1."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  return 1


def _checked(kind: Callable[[str], float], ok: Callable[[float], bool], what: str) -> Any:
  """An argparse type: ``kind(text)`` where ``ok``, else an error saying it ``must be what``."""

  def parse(text: str) -> float:
    try:
      value = kind(text)
    except ValueError:
      value = math.nan
    if not ok(value):
      raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value

  return parse


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
  """The ``optax-dls`` parser and its ``inspect`` sub-parser."""
  parser = argparse.ArgumentParser(
    prog="optax-dls", description="Tools for optax_dls loss-scaled training runs."
  )
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("inspect", help="summarise and diagnose the loss-scale logs of a run folder")
  p.add_argument(
    "run_dir",
    help="folder with *.jsonl files (as MetricsWriter writes) or TensorBoard event files "
    "(searched recursively)",
  )
  p.add_argument(
    "--plot",
    metavar="OUT.png",
    help="also draw the loss scale, loss, gradient norm and skips into this image",
  )
  p.add_argument("--json", action="store_true", help="print the summary and diagnosis as JSON")
  p.add_argument(
    "--follow",
    action="store_true",
    help="keep reading the logs as they grow and show each run's current state, every 2 s "
    "(Ctrl-C to stop)",
  )
  seconds = _checked(float, lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0")
  p.add_argument(
    "--watch", metavar="SECONDS", type=seconds, help="like --follow, every SECONDS seconds"
  )
  count = _checked(int, lambda v: v >= 1, "a whole number >= 1")
  p.add_argument("--max-refreshes", type=count, help=argparse.SUPPRESS)  # for tests: then stop
  return parser, p


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``optax-dls`` command.

  Args:
    argv: the arguments after the program name; default None: ``sys.argv[1:]``.

  Returns:
    The exit code, an ``int``: 0 success (also ``--help``, and Ctrl-C ending ``--follow``); 1 the
    output was closed early (``| head``); 2 no readable logs, a missing optional dependency (naming
    ``pip install -e ".[monitoring]"``), or a usage error (a bad ``--plot``, ``--watch 0``).
  """
  try:
    return _main(argv)
  except SystemExit as e:  # argparse's exit: --help (0) or a usage error (2)
    return e.code if isinstance(e.code, int) else 2


def _main(argv: Sequence[str] | None) -> int:
  parser, p = _parser()
  args = parser.parse_args(argv)
  err = "optax-dls inspect: error:"
  if args.follow or args.watch is not None or args.max_refreshes is not None:
    if args.plot or args.json:
      p.error("argument --follow/--watch: not allowed with --plot or --json")
    if os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
      print(f"{err} {args.run_dir!r} is not a folder.", file=sys.stderr)
      return 2
    try:
      return _live.follow(args.run_dir, args.watch or 2.0, refreshes=args.max_refreshes)
    except BrokenPipeError:
      return _closed_pipe()
  try:
    if args.plot and (why := _report.check_path(args.plot)):
      p.error(f"argument --plot: {why}")
    text = _report.inspect(args.run_dir, args.plot, args.json)
  except (NoLogsError, MissingExtraError) as e:
    print(f"{err} {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"{err} cannot write the plot {args.plot!r}: {e}", file=sys.stderr)
    return 2
  try:
    print(text, flush=True)
  except BrokenPipeError:
    return _closed_pipe()
  return 0


if __name__ == "__main__":
  sys.exit(main())
