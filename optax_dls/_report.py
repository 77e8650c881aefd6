"""The report of ``optax-dls inspect``: each run's summary and diagnosis, as text or as JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from optax_dls import _diagnosis, _summary

Rows = list[dict[str, Any]]


def build(runs: dict[str, Rows]) -> dict[str, dict[str, Any]]:
  """``{run: {"summary": ..., "diagnosis": [{"symptom": ..., "advice": ...}]}}`` for ``runs``.

  Runs logged beside each other are compared for the share of exactly-zero
  gradients (see :func:`optax_dls._diagnosis.zero_floor`).

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
      f"  logged steps {summary['steps_at_min_scale']} at the lowest scale, "
      f"{summary['steps_at_max_scale']} at the highest"
    )
  if summary["fp32_fallback_steps"]:
    lines.append(f"  fp32 fallback on at {summary['fp32_fallback_steps']} logged steps")
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
