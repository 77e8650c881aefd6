"""The report of ``optax-dls inspect``: each run's summary and diagnosis, as text or as JSON,
the saved :func:`optax_dls.locate` reports of the run folder, and the plot."""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

from optax_dls._logs import diagnosis as _diagnosis
from optax_dls._logs import plot as _plot
from optax_dls._logs import read as _read
from optax_dls._logs import summary as _summary
from optax_dls._util import locate_report as _headroom

Rows = list[dict[str, Any]]
LOCATE_NAME = "locate.json"  # as optax_dls.writers.LOCATE_NAME


def inspect(
  run_dir: str | os.PathLike, plot_path: str | os.PathLike | None = None, as_json: bool = False
) -> str:
  """The report ``optax-dls inspect`` prints: the text of :func:`text`, then each saved
  :func:`optax_dls.locate` report (a ``locate.json`` that
  :meth:`~optax_dls.writers.MetricsWriter.write_locate` wrote) under ``run_dir``, then the
  plot's path when one was drawn (into ``plot_path``); or, ``as_json``, the JSON of
  :func:`to_json`.

  Raises:
    NoLogsError: no readable logs under ``run_dir``.
    TypeError: ``run_dir`` is not a path.
    MissingExtraError: ``tensorboard`` for event files, ``matplotlib`` for the plot.
  """
  runs = _read.load_runs(run_dir)
  report = build(runs)
  if plot_path is not None:
    _plot.plot(runs, os.fspath(plot_path))
  if as_json:
    return to_json(report)
  out = text(report)
  saved = saved_locate_text(run_dir)
  out = f"{out}\n\n{saved}" if saved else out
  return out + f"\nplot written to {os.fspath(plot_path)}" if plot_path is not None else out


def build(runs: dict[str, Rows]) -> dict[str, dict[str, Any]]:
  """``{run: {"summary": ..., "diagnosis": [{"symptom": ..., "advice": ...}]}}`` for ``runs``.

  Runs logged beside each other are compared for the share of exactly-zero
  gradients (see :func:`optax_dls._logs.diagnosis.zero_floor`).

  Args:
    runs: ``{run name: rows sorted by step}``, each with at least one row.
  """
  floor = _diagnosis.zero_floor(runs)
  report = {}
  for name, rows in runs.items():
    summary = _summary.summarize(rows)
    found = _diagnosis.diagnose(rows, summary, floor if floor and floor[0] != name else None)
    report[name] = {
      "summary": summary,
      "diagnosis": [{"symptom": s, "advice": a} for s, a in found],
    }
  return report


def to_json(report: dict[str, dict[str, Any]]) -> str:
  """``report`` as indented JSON, NaN as ``null``."""
  return json.dumps(
    report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x
  )


def _or_unknown(value: Any, fmt: str = "{}") -> str:
  return "unknown" if value is None else fmt.format(value)


def summary_lines(summary: dict[str, Any]) -> list[str]:
  """The summary of one run as indented text lines."""
  streak = _or_unknown(summary["longest_skip_streak"])
  if summary["longest_skip_streak"] is not None and not summary["every_update_logged"]:
    streak = f"at least {streak}"  # a longer one may lie between two logged rows
  updates = f"{_or_unknown(summary['updates'])} updates"
  if summary["applied_updates"] is not None:
    updates += f": {summary['applied_updates']} applied, {summary['skips']} skipped"
  steps = (
    f"  steps        {summary['first_step']}..{summary['last_step']} "
    f"({summary['logged_steps']} logged steps, {updates})"
  )
  skips = (
    f"  skips        {_or_unknown(summary['skips'])}  (update ratio "
    f"{_or_unknown(summary['update_ratio'], '{:.4f}')}, longest streak {streak})"
  )
  lines = [steps, skips]
  if "scale_min" in summary:
    text = _summary.scale_text
    lines.append(
      f"  loss scale   lowest {text(summary['scale_min'])} / median "
      f"{text(summary['scale_median'])} / highest {text(summary['scale_max'])} (logged)"
    )
    lines.append(
      f"  at the lowest scale {_count(summary['steps_at_min_scale'], 'logged step')}, at the "
      f"highest {_count(summary['steps_at_max_scale'], 'logged step')}"
    )
  if summary["fp32_fallback_steps"]:
    lines.append(f"  fp32 fallback on at {summary['fp32_fallback_steps']} logged steps")
  if groups := summary.get("overflows_by_group"):
    counts = ", ".join(f"{label} {n}" for label, n in groups.items())
    lines.append(f"  overflows    by parameter group: {counts}")
  return lines + nonfinite_lines(summary)


def _count(n: int, what: str) -> str:
  """``n`` things as a count that cannot be read as a step number: ``"8 logged steps"``."""
  return f"{n} {what}{'s' * (n != 1)}"


_SHOWN = 5  # parameters listed


def _kind(entry: dict[str, Any]) -> str:
  if entry["nan"] and entry["inf"]:
    return f"nan on {entry['nan']}, inf on {entry['inf']}"
  return "nan" if entry["nan"] else "inf"


def last_nonfinite(summary: dict[str, Any], shown: int = _SHOWN) -> str | None:
  """The last recorded non-finite step and its leaves, e.g. ``"step 117: dense/kernel (inf)"``,
  or None."""
  last = (summary.get("nonfinite") or {}).get("last")
  if not last:
    return None
  leaves = [f"{name} ({kind})" for name, kind in last["leaves"].items()]
  more = f" and {len(leaves) - shown} more" if len(leaves) > shown else ""
  loss = ", the loss not finite" if last["loss"] else ""
  unit = summary["nonfinite"]["numbering"]
  at = f"{unit} {last['step']}"
  if unit == "step" and last["update"] != last["step"]:  # say it as metrics numbers it too
    at += f" (nonfinite_step {last['update']} in metrics)"
  return f"{at}{loss}: {', '.join(leaves[:shown]) or 'no leaf'}{more}"


def nonfinite_lines(summary: dict[str, Any]) -> list[str]:
  """Which parameters the recorded non-finite steps came from, most often first."""
  where = summary.get("nonfinite")
  if not where or not where["steps_with_leaves"]:
    return []
  n, skips = where["steps_with_leaves"], summary["skips"]
  of = f", of {skips} skipped" if skips is not None and n < skips else ""
  lines = [f"  non-finite steps by parameter (the {n} the logs record{of}):"]
  for entry in where["by_parameter"][:_SHOWN]:
    lines.append(f"    {entry['name']}  {entry['steps']} of {n} ({_kind(entry)})")
  if len(where["by_parameter"]) > _SHOWN:
    lines.append(f"    ... and {len(where['by_parameter']) - _SHOWN} more")
  lines.append(f"  last non-finite {last_nonfinite(summary)}")
  return lines


def text(report: dict[str, dict[str, Any]]) -> str:
  """``report`` as the text ``optax-dls inspect`` prints."""
  lines = []
  for name, r in report.items():
    lines.append(f"run {name}")
    lines.extend(summary_lines(r["summary"]))
    for d in r["diagnosis"]:
      lines.append(f"  ! {d['symptom']}")
      lines.append(f"    -> {d['advice']}")
    if not r["diagnosis"]:
      lines.append("  no loss-scaling problems found")
  return "\n".join(lines)


def saved_locate_text(run_dir: str | os.PathLike) -> str:
  """The saved reports under ``run_dir`` (searched recursively), as text; ``""`` when none.
  A file that is not a report is named with the reason instead."""
  parts = []
  for path in sorted(pathlib.Path(run_dir).rglob(LOCATE_NAME)):
    try:
      data = json.loads(path.read_text(encoding="utf-8"))
      shown = str(_headroom.LocateReport.from_dict(data))
    except (OSError, ValueError, TypeError, KeyError) as e:
      parts.append(f"{path}: not a locate report ({type(e).__name__}: {e})")
      continue
    step = f" (the batch of step {data['step']})" if "step" in data else ""
    parts.append(f"{path}{step}:\n{shown}")
  return "\n".join(parts)
