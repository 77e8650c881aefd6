"""``optax-dls inspect RUN_DIR``: summarise and diagnose a run's loss-scale logs.

Reads the ``metrics.jsonl`` files written by :class:`optax_dls.writers.MetricsWriter`
(or any JSON lines with a ``step`` key and the keys of :func:`optax_dls.metrics`)
and, where there are none, TensorBoard event files. Prints per run: steps, skips,
update ratio, longest skip streak, loss scale min / median / max, logged steps at
the minimum and maximum scale, then a diagnosis of the usual symptoms with what
to do about each. ``--plot out.png`` draws the loss scale and the skips.

Malformed rows (a ``step`` that is not a whole number, lines that are not JSON)
and unreadable files are skipped with a warning on stderr.

Exit codes: 0 success, 2 no logs found, only unreadable logs, or a bad
argument (e.g. ``--plot`` into a missing folder or with an unknown extension).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from optax_dls import writers

_KEYS = ("loss_scale", "skipped", "skip_count", "consecutive_skips", "num_steps",
         "update_ratio", "grad_norm", "fp32_fallback", "loss")

# Diagnosis thresholds.
OVERFLOW_RATE = 0.01      # skips per update, second half of the run
NO_GROWTH_UPDATES = 1000  # updates without any growth before "never grows"
UNDERFLOW_FRAC = 0.01     # median fp16-subnormal fraction of the unscaled gradients
ZERO_FRAC = 0.25          # median fraction of exactly-zero unscaled gradients
STUCK_MIN_ROWS = 3        # skipped logged steps at a minimum scale <= 1
DIVERGE_FACTOR = 1.5      # last-tenth mean loss over first-tenth mean loss


class NoLogsError(Exception):
  """No metrics logs under the run folder."""


def _canonical(key: str) -> str:
  """Maps tags such as ``train/loss_scale`` or ``optax_dls/underflow/zero_frac`` to our keys."""
  if "underflow/" in key:
    return key[key.index("underflow/"):]
  for k in _KEYS:
    if key == k or key.endswith("/" + k):
      return k
  return key


def _train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rows with loss-scale metrics (e.g. not validation rows), or all if none has them."""
  kept = [r for r in rows if "loss_scale" in r or "skipped" in r]
  return kept or rows


def _step(value: Any) -> int | None:
  """A row's step as an int, or None when it is not a whole finite number (a malformed row)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
    return None
  return int(value) if abs(value) < 2**63 else None


def _read(path: str, reader: Any) -> tuple[list[dict[str, Any]], int]:
  """The well-formed rows of one log file and the count of malformed ones (never raises on content)."""
  try:
    raw = reader(path)
  except Exception as e:  # noqa: BLE001  (OSError, or e.g. a protobuf DecodeError on a corrupt event file)
    _warn(path, f"unreadable ({type(e).__name__}: {e})")
    return [], 1
  rows, bad = [], 0
  for row in raw:
    step = _step(row.get("step"))
    if step is None:
      bad += 1
      continue
    rows.append({**row, "step": step})
  if bad:
    _warn(path, f"skipped {bad} row(s) whose 'step' is not a whole number")
  return rows, bad


def _warn(path: str, what: str) -> None:
  print(f"optax-dls inspect: warning: {path}: {what}", file=sys.stderr)


def load_runs(run_dir: str) -> dict[str, list[dict[str, Any]]]:
  """``{run name: rows sorted by step}`` from the JSONL files under ``run_dir``, or,
  where there are none, from its TensorBoard event files.

  Malformed rows (a ``step`` that is not a whole number) and unreadable files
  are skipped with a warning on stderr.

  Raises:
    NoLogsError: ``run_dir`` is missing, holds no logs, or only unreadable ones.
  """
  if not os.path.isdir(run_dir):
    raise NoLogsError(f"{run_dir!r} is not a folder.")
  jsonl, events = [], []
  for root, _, files in os.walk(run_dir):
    for name in sorted(files):
      if name.endswith(".jsonl"):
        jsonl.append(os.path.join(root, name))
      elif name.startswith("events.out.tfevents"):
        events.append(os.path.join(root, name))
  runs: dict[str, list[dict[str, Any]]] = {}
  files = ([(p, writers.read_jsonl) for p in sorted(jsonl)] or
           [(p, writers.read_tensorboard) for p in sorted(events)])
  for path, reader in files:
    default = os.path.relpath(os.path.dirname(path), run_dir)
    for row in _read(path, reader)[0]:
      row = {_canonical(k): v for k, v in row.items()}
      name = str(row.get("run", default if default != "." else os.path.basename(os.path.abspath(run_dir))))
      runs.setdefault(name, []).append(row)
  runs = {k: sorted(_train_rows(v), key=lambda r: r["step"]) for k, v in runs.items() if v}
  if not runs and files:
    raise NoLogsError(
        f"the logs under {run_dir!r} exist but are unreadable: none of {len(files)} file(s) "
        f"({', '.join(p for p, _ in files[:3])}{', ...' if len(files) > 3 else ''}) holds a row "
        "with a whole-number 'step'.")
  if not runs:
    raise NoLogsError(
        f"no metrics logs under {run_dir!r}: expected *.jsonl files with a 'step' key "
        "(optax_dls.writers.MetricsWriter) or TensorBoard event files (events.out.tfevents.*).")
  return runs


def _number(value: Any) -> float:
  if not isinstance(value, (int, float)):
    return np.nan  # a string, list, null, ...: malformed, ignored
  try:
    return float(value)
  except OverflowError:  # an integer beyond float range
    return np.nan


def _column(rows: list[dict[str, Any]], key: str) -> np.ndarray:
  return np.array([_number(r.get(key)) for r in rows], dtype=np.float64)


def _longest_true_run(flags: np.ndarray) -> int:
  best = cur = 0
  for f in flags:
    cur = cur + 1 if f else 0
    best = max(best, cur)
  return best


def _finite_max(x: np.ndarray, default: Any) -> Any:
  """Largest finite entry of ``x`` (non-finite counters are malformed), else ``default``."""
  x = x[np.isfinite(x) & (np.abs(x) < 2.0**63)]
  return x.max() if x.size else default


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Summary numbers of one run's rows (see the module docstring)."""
  steps = _column(rows, "step")
  scale = _column(rows, "loss_scale")
  skipped = _column(rows, "skipped") > 0
  num_steps = _column(rows, "num_steps")
  skip_count = _column(rows, "skip_count")
  updates = int(_finite_max(num_steps, len(rows)))
  skips = int(_finite_max(skip_count, skipped.sum()))
  consec = _column(rows, "consecutive_skips")
  streak = int(_finite_max(consec, _longest_true_run(skipped)))
  s = scale[np.isfinite(scale)]
  out = {
      "logged_steps": len(rows), "first_step": int(steps[0]), "last_step": int(steps[-1]),
      "updates": updates, "skips": skips,
      "update_ratio": (updates - skips) / updates if updates else 1.0,
      "longest_skip_streak": streak,
      "fp32_fallback_steps": int((_column(rows, "fp32_fallback") > 0).sum()),
  }
  if s.size:
    out.update(scale_min=float(s.min()), scale_median=float(np.median(s)), scale_max=float(s.max()),
               steps_at_min_scale=int((s == s.min()).sum()), steps_at_max_scale=int((s == s.max()).sum()),
               scale_increases=int((np.diff(s) > 0).sum()))
  return out


def _second_half(x: np.ndarray) -> np.ndarray:
  return x[len(x) // 2:]


def diagnose(rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[tuple[str, str]]:
  """``[(symptom, what to do)]`` for the usual loss-scaling problems seen in ``rows``."""
  found = []
  scale = _column(rows, "loss_scale")
  skipped = _column(rows, "skipped") > 0
  num_steps, skip_count = _column(rows, "num_steps"), _column(rows, "skip_count")
  half = len(rows) // 2
  # Dynamic scaling probes: each growth is normally followed by one overflow. Only skips
  # beyond one per growth in the second half count as "frequent overflow".
  tail = _second_half(scale)
  growths = int((np.diff(tail[np.isfinite(tail)]) > 0).sum())
  if np.isfinite(num_steps[half:]).all() and np.isfinite(skip_count[half:]).all() and len(rows) > 1:
    span = num_steps[-1] - num_steps[half]
    excess = skip_count[-1] - skip_count[half] - growths
    rate = max(excess, 0) / span if span > 0 else 0.0
  else:
    rate = max(float(_second_half(skipped).sum()) - growths, 0) / max(len(tail), 1)
  stuck = skipped & np.isfinite(scale) & (scale <= min(summary.get("scale_min", np.inf), 1.0))
  if rate > OVERFLOW_RATE and stuck.sum() < STUCK_MIN_ROWS:  # stuck at the minimum says more
    found.append((
        f"frequent overflow: {rate:.1%} of the updates in the second half of the run were skipped "
        "beyond the one overflow per growth that dynamic scaling uses to probe",
        "Gradients or activations overflow float16 again and again. Lower the learning rate or add "
        "warm-up, clip gradients (optax.clip_by_global_norm inside the loss-scaled optimizer), use "
        "hysteresis=2 to ride out isolated spikes, keep softmax / normalisation / loss in float32, or "
        "train in bfloat16."))
  if summary.get("scale_increases", 1) == 0 and summary["updates"] >= NO_GROWTH_UPDATES:
    found.append((
        f"scale never grows: {summary['updates']} updates without a single increase "
        f"(scale stays at or below {summary.get('scale_max', float('nan')):g})",
        "Either growth_interval (or warmup_steps) is longer than the run, the scale started at "
        "max_scale, or overflows keep resetting the growth tracker. Shorten growth_interval "
        "(e.g. 1000), check warmup_steps, or raise max_scale."))
  sub = _second_half(_column(rows, "underflow/subnormal_frac"))
  zero = _second_half(_column(rows, "underflow/zero_frac"))
  sub_med = float(np.nanmedian(sub)) if np.isfinite(sub).any() else 0.0
  zero_med = float(np.nanmedian(zero)) if np.isfinite(zero).any() else 0.0
  at_max = summary.get("steps_at_max_scale", 0) / max(len(rows), 1)
  if sub_med > UNDERFLOW_FRAC or zero_med > ZERO_FRAC:
    found.append((
        f"gradients too small: median {sub_med:.1%} of the unscaled gradients are float16-subnormal "
        f"and {zero_med:.1%} exactly zero",
        "Small gradients lose precision or vanish in float16. Raise init_scale and max_scale "
        "(optax_dls.preset('qlora') starts at 2**16), average the loss over tokens rather than "
        "summing per-token losses at a tiny learning rate, watch each parameter group with "
        "underflow_stats=label_fn, or train in bfloat16."))
  elif at_max > 0.5 and summary.get("scale_max", 0) >= 2.0**24 and summary["skips"] == 0:
    found.append((
        f"scale pinned at its maximum {summary['scale_max']:g} for {at_max:.0%} of the logged steps",
        "The gradients are small enough that the scale never overflows; if max_scale caps it, "
        "raise max_scale and log underflow_stats to see whether gradients underflow."))
  if stuck.sum() >= STUCK_MIN_ROWS:
    found.append((
        f"stuck at the minimum: {int(stuck.sum())} logged steps were skipped with the scale at "
        f"{summary['scale_min']:g}",
        "Non-finite values even at the smallest scale come from the forward pass or the data, not "
        "from loss scaling: look for inf/NaN inputs or labels, run with jax_debug_nans, lower the "
        "learning rate, keep the loss and normalisation in float32, or turn on the float32 "
        "fallback (fallback_after=10 with optax_dls.select_precision)."))
  loss = _column(rows, "loss")
  ok = ~skipped
  if ok.sum() >= 20:
    applied = loss[ok]
    tenth = max(len(applied) // 10, 1)
    first, last = applied[:tenth], applied[-tenth:]
    nonfinite = not np.isfinite(last).all()
    if nonfinite or (np.isfinite(first).all() and np.mean(last) > DIVERGE_FACTOR * abs(np.mean(first))):
      found.append((
          "diverging loss: " + ("non-finite loss on applied steps at the end of the run" if nonfinite
                                else f"mean loss rose from {np.mean(first):.4g} to {np.mean(last):.4g}"),
          "Lower the peak learning rate or lengthen its warm-up, clip gradients, check the data "
          "order and the labels. Loss scaling skips non-finite steps, but it cannot undo finite "
          "updates that are too large."))
  return found


def _fmt(summary: dict[str, Any]) -> list[str]:
  lines = [
      f"  steps        {summary['first_step']}..{summary['last_step']} "
      f"({summary['logged_steps']} logged, {summary['updates']} updates)",
      f"  skips        {summary['skips']}  (update ratio {summary['update_ratio']:.4f}, "
      f"longest streak {summary['longest_skip_streak']})",
  ]
  if "scale_min" in summary:
    lines.append(f"  loss scale   min {summary['scale_min']:g} / median {summary['scale_median']:g} / "
                 f"max {summary['scale_max']:g}")
    lines.append(f"  at min scale {summary['steps_at_min_scale']} logged steps; at max scale "
                 f"{summary['steps_at_max_scale']} logged steps")
  if summary["fp32_fallback_steps"]:
    lines.append(f"  fp32 fallback on for {summary['fp32_fallback_steps']} logged steps")
  return lines


def plot(runs: dict[str, list[dict[str, Any]]], out: str) -> None:
  """Draws the loss scale (log2 axis, skipped steps marked) and the cumulative skips into ``out``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_s, ax_k) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
  for name, rows in runs.items():
    steps, scale = _column(rows, "step"), _column(rows, "loss_scale")
    skipped = _column(rows, "skipped") > 0
    line, = ax_s.plot(steps, scale, label=name)
    ax_s.plot(steps[skipped], scale[skipped], "x", color=line.get_color())
    count = _column(rows, "skip_count")
    ax_k.step(steps, count if np.isfinite(count).any() else np.cumsum(skipped), where="post", label=name)
  ax_s.set_yscale("log", base=2)
  ax_s.set_ylabel("loss scale (x: skipped)")
  ax_k.set_ylabel("skipped steps (cumulative)")
  ax_k.set_xlabel("step")
  ax_s.legend(loc="best")
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)


def inspect(run_dir: str, plot_path: str | None = None, as_json: bool = False) -> str:
  """The report printed by ``optax-dls inspect`` (raises :class:`NoLogsError`)."""
  runs = load_runs(run_dir)
  report = {}
  for name, rows in runs.items():
    summary = summarize(rows)
    report[name] = {"summary": summary,
                    "diagnosis": [{"symptom": s, "advice": a} for s, a in diagnose(rows, summary)]}
  if plot_path:
    plot(runs, plot_path)
  if as_json:
    return json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
  lines = []
  for name, r in report.items():
    lines.append(f"run {name}")
    lines.extend(_fmt(r["summary"]))
    if r["diagnosis"]:
      for d in r["diagnosis"]:
        lines.append(f"  ! {d['symptom']}")
        lines.append(f"    -> {d['advice']}")
    else:
      lines.append("  no loss-scaling problems found")
  if plot_path:
    lines.append(f"plot written to {plot_path}")
  return "\n".join(lines)


def _check_plot_path(parser: argparse.ArgumentParser, path: str) -> None:
  """Exits 2 (argparse error) unless ``path`` is in an existing folder with an image extension."""
  from matplotlib.backend_bases import FigureCanvasBase

  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    parser.error(f"argument --plot: the folder {os.path.dirname(path) or folder!r} does not exist")
  ext = os.path.splitext(path)[1].lstrip(".").lower()
  kinds = FigureCanvasBase.get_supported_filetypes()
  if ext not in kinds:
    parser.error(f"argument --plot: unsupported image extension {ext or '(none)'!r} in {path!r}; "
                 f"use one of {', '.join(sorted(kinds))}")


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``optax-dls`` command; returns the exit code."""
  parser = argparse.ArgumentParser(prog="optax-dls", description="Tools for optax_dls loss-scaled training runs.")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("inspect", help="summarise and diagnose the loss-scale logs of a run folder")
  p.add_argument("run_dir", help="folder with metrics.jsonl files or TensorBoard event files (searched recursively)")
  p.add_argument("--plot", metavar="OUT.png", help="also draw the loss scale and the skips into this image")
  p.add_argument("--json", action="store_true", help="print the summary and diagnosis as JSON")
  args = parser.parse_args(argv)
  if args.plot:
    _check_plot_path(p, args.plot)
  try:
    text = inspect(args.run_dir, args.plot, args.json)
  except NoLogsError as e:
    print(f"optax-dls inspect: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"optax-dls inspect: error: cannot write the plot {args.plot!r}: {e}", file=sys.stderr)
    return 2
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
