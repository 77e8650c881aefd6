"""The report of ``optax-dls inspect``: each run's summary and diagnosis, as text or as JSON,
the saved :func:`optax_dls.locate` reports of the run folder, and the plot."""

from __future__ import annotations

import json
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
_SHOWN = 5  # parameters listed


def inspect(
  run_dir: str | os.PathLike, plot_path: str | os.PathLike | None = None, as_json: bool = False
) -> str:
  """What ``optax-dls inspect`` prints: each run's summary and diagnosis, then the saved
  ``locate.json`` reports under ``run_dir``, then the plot's path when one was drawn (into
  ``plot_path``); or, ``as_json``, the summaries and diagnoses as JSON.

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
    return json.dumps(report, indent=2)
  out = "\n\n".join(part for part in (text(report), saved_locate_text(run_dir)) if part)
  return out + f"\nplot written to {os.fspath(plot_path)}" if plot_path is not None else out


def build(runs: dict[str, Rows]) -> dict[str, dict[str, Any]]:
  """``{run: {"summary": ..., "diagnosis": [{"symptom": ..., "advice": ...}]}}`` of ``runs``
  (``{name: rows sorted by step}``), compared for their shares of zero gradients."""
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


def or_unknown(value: Any, fmt: str = "{}") -> str:
  return "unknown" if value is None else fmt.format(value)


def _count(n: int) -> str:
  """``n`` as a count that cannot be read as a step number: ``"8 logged steps"``."""
  return f"{n} logged step{'s' * (n != 1)}"


def summary_lines(summary: dict[str, Any]) -> list[str]:
  """The summary of one run as indented text lines."""
  s = summary
  streak = or_unknown(s["longest_skip_streak"])
  if s["longest_skip_streak"] is not None and not s["every_update_logged"]:
    streak = f"at least {streak}"  # a longer one may lie between two logged rows
  updates = f"{or_unknown(s['updates'])} updates"
  if s["applied_updates"] is not None:
    updates += f": {s['applied_updates']} applied, {s['skips']} skipped"
  ratio, span = or_unknown(s["update_ratio"], "{:.4f}"), f"{s['first_step']}..{s['last_step']}"
  lines = [
    f"  steps        {span} ({s['logged_steps']} logged steps, {updates})",
    f"  skips        {or_unknown(s['skips'])}  (update ratio {ratio}, longest streak {streak})",
  ]
  if "scale_min" in s:
    power = _summary.scale_text
    lines.append(
      f"  loss scale   lowest {power(s['scale_min'])} / median {power(s['scale_median'])} / "
      f"highest {power(s['scale_max'])} (logged)"
    )
    lines.append(
      f"  at the lowest scale {_count(s['steps_at_min_scale'])}, at the highest "
      f"{_count(s['steps_at_max_scale'])}"
    )
  if s["fp32_fallback_steps"]:
    lines.append(f"  fp32 fallback on at {s['fp32_fallback_steps']} logged steps")
  if groups := s.get("overflows_by_group"):
    counts = ", ".join(f"{label} {n}" for label, n in groups.items())
    lines.append(f"  overflows    by parameter group: {counts}")
  where = s.get("nonfinite")
  if not where or not (n := where["steps_with_leaves"]):
    return lines
  of = f", of {s['skips']} skipped" if s["skips"] is not None and n < s["skips"] else ""
  lines.append(f"  non-finite steps by parameter (the {n} the logs record{of}):")
  for e in where["by_parameter"][:_SHOWN]:
    kind = "nan" if e["nan"] else "inf"
    if e["nan"] and e["inf"]:
      kind = f"nan on {e['nan']}, inf on {e['inf']}"
    lines.append(f"    {e['name']}  {e['steps']} of {n} ({kind})")
  if len(where["by_parameter"]) > _SHOWN:
    lines.append(f"    ... and {len(where['by_parameter']) - _SHOWN} more")
  return lines + [f"  last non-finite {last_nonfinite(s)}"]


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


def text(report: dict[str, dict[str, Any]]) -> str:
  """``report`` as the text ``optax-dls inspect`` prints."""
  lines = []
  for name, r in report.items():
    lines += [f"run {name}", *summary_lines(r["summary"])]
    for d in r["diagnosis"]:
      lines += [f"  ! {d['symptom']}", f"    -> {d['advice']}"]
    if not r["diagnosis"]:
      lines.append("  no loss-scaling problems found")
  return "\n".join(lines)


def saved_locate_text(run_dir: str | os.PathLike) -> str:
  """The saved reports under ``run_dir`` (searched recursively) as text, ``""`` when none; a
  file that is not a report is named with the reason."""
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
