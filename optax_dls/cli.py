"""``optax-dls inspect RUN_DIR``: summarise and diagnose a run's loss-scale logs, once or live.

Reads, per folder under ``RUN_DIR``, the ``*.jsonl`` files written by
:class:`optax_dls.writers.MetricsWriter` (or any JSON lines with a ``step`` key and the
keys of :func:`optax_dls.metrics`), or, in a folder without them, its TensorBoard event
files (read with TensorBoard's event-file loader; a run's TensorBoard copy beside its
JSON lines is read once). Prints per run: steps, updates (applied and skipped), skips,
update ratio, longest logged skip streak, the lowest / median / highest logged loss
scale (as powers of two: ``2^k``, ``2^x`` with two decimals between two powers), the
logged steps at the lowest and highest scale, the overflows per parameter group and the
non-finite steps by parameter (inf or NaN) where the logs carry them, then a diagnosis
of the usual symptoms with what to do about each. ``--plot out.png`` draws each logged
quantity (loss scale, loss, gradient norm, skips, recomputed steps) in a panel of its
own, skipped and recomputed steps marked; ``--json`` prints the summary and diagnosis as
JSON. ``--follow`` (every 2 s) or ``--watch SECONDS`` keeps reading the logs as they
grow and shows the current state of every run until Ctrl-C.

The logs may be written every ``k`` steps. The diagnosis then rests on the
cumulative counters of the logged rows (``num_steps``, ``skip_count``, or
``update_ratio``) and on the loss scale at each logged row: what happened
between two rows is bounded, not guessed, and a problem is reported only where
the logged rows prove it, so a sparser log may show less but never something
false. The bounds take a growth to double the scale and a skip to halve it at
most, as the defaults of every built-in dynamic rule and compatibility preset
do; where the logged scales show another rule (a ratio that is not a power of
two, or a drop of more octaves than skips, as ``amax_policy``'s), only the
counters are used. A column that is missing is unknown: the diagnoses that
need it are not made. Without ``num_steps``, each step is taken to be one
update. Rows logged twice for one step (a resumed run) are merged, the later
values winning.

Lines that are not JSON objects with a ``step``, rows whose ``step`` is not a
whole number, undecodable TensorBoard records and unreadable files are
skipped, each on its own, and counted in a warning on stderr. A corrupt
TensorBoard record stops the reading of its file there: the warning says from
which byte on it is lost.

Exit codes: 0 success (and Ctrl-C ending ``--follow``); 1 the output was
closed early (e.g. ``| head``); 2 no logs found, only unreadable logs, a
missing optional dependency (one line naming ``pip install
"optax_dls[monitoring]"``), or a bad argument (e.g. ``--plot`` into a missing
folder or with an unknown extension, ``--watch 0``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from optax_dls._logs import live as _live
from optax_dls._logs import plot as _plot
from optax_dls._logs import report as _report
from optax_dls._logs.read import NoLogsError
from optax_dls._util.optional import MissingExtraError

__all__ = ["main"]


def _closed_pipe() -> int:
  """Sends stdout to devnull, so that the interpreter's final flush does not fail on the closed
  pipe too (as the Python docs recommend); returns the exit code 1."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, sys.stdout.fileno())
  return 1


def _print(text: str) -> int:
  """Prints ``text``; 0, or 1 when the reader closed the pipe."""
  try:
    print(text)
    sys.stdout.flush()
  except BrokenPipeError:
    return _closed_pipe()
  return 0


def _seconds(text: str) -> float:
  """``--watch``'s value: a finite number of seconds > 0."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
  return value


def _count(text: str) -> int:
  """``--max-refreshes``'s value: an int >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
  return value


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
  p.add_argument(
    "--watch", metavar="SECONDS", type=_seconds, help="like --follow, every SECONDS seconds"
  )
  p.add_argument("--max-refreshes", type=_count, help=argparse.SUPPRESS)  # for tests: then stop
  return parser, p


def _follow(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """``inspect --follow`` / ``--watch``: the live view until Ctrl-C (exit code 0)."""
  if args.plot or args.json:
    p.error("argument --follow/--watch: not allowed with --plot or --json")
  if os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
    print(f"optax-dls inspect: error: {args.run_dir!r} is not a folder.", file=sys.stderr)
    return 2
  interval = 2.0 if args.watch is None else args.watch
  try:
    return _live.follow(args.run_dir, interval, refreshes=args.max_refreshes)
  except BrokenPipeError:
    return _closed_pipe()


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``optax-dls`` command; returns the exit code.

  Args:
    argv: the arguments after the program name; default None: ``sys.argv[1:]``.

  Returns:
    The exit code, an ``int``: 0, 1 or 2 as in this module's docstring.
  """
  parser, p = _parser()
  args = parser.parse_args(argv)
  if args.follow or args.watch is not None or args.max_refreshes is not None:
    return _follow(p, args)
  try:
    if args.plot and (why := _plot.check_path(args.plot)):
      p.error(f"argument --plot: {why}")
    text = _report.inspect(args.run_dir, args.plot, args.json)
  except (NoLogsError, MissingExtraError) as e:
    print(f"optax-dls inspect: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"optax-dls inspect: error: cannot write the plot {args.plot!r}: {e}", file=sys.stderr)
    return 2
  return _print(text)


if __name__ == "__main__":
  sys.exit(main())
