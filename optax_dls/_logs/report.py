"""The report of ``optax-dls inspect``: summaries, diagnoses, saved locate reports, the plot."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from optax_dls._logs import diagnosis as _diagnosis
from optax_dls._logs import read as _read
from optax_dls._util import locate_report as _headroom
from optax_dls._util import optional as _optional


def inspect(
  run_dir: str | os.PathLike, plot_path: str | os.PathLike | None = None, as_json: bool = False
) -> str:
  """What ``optax-dls inspect`` prints (``as_json``: JSON), the plot drawn into ``plot_path``."""
  runs = _read.load_runs(run_dir)
  report = build(runs)
  if plot_path is not None:
    plot(runs, os.fspath(plot_path))
  if as_json:
    return json.dumps(report, indent=2)
  out = "\n\n".join(part for part in (text(report), saved_locate_text(run_dir)) if part)
  return out + f"\nplot written to {os.fspath(plot_path)}" if plot_path is not None else out


def build(runs: dict[str, _read.Rows]) -> dict[str, dict[str, Any]]:
  """``{run: {"summary": ..., "diagnosis": [{"symptom": ..., "advice": ...}]}}`` of ``runs``."""
  floor = _diagnosis.zero_floor(runs)
  report = {}
  for name, rows in runs.items():
    summary = _diagnosis.summarize(rows)
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
    power = _diagnosis.scale_text
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
  for e in where["by_parameter"][: _read.SHOWN]:
    kind = "nan" if e["nan"] else "inf"
    if e["nan"] and e["inf"]:
      kind = f"nan on {e['nan']}, inf on {e['inf']}"
    lines.append(f"    {e['name']}  {e['steps']} of {n} ({kind})")
  if len(where["by_parameter"]) > _read.SHOWN:
    lines.append(f"    ... and {len(where['by_parameter']) - _read.SHOWN} more")
  return lines + [f"  last non-finite {last_nonfinite(s)}"]


def last_nonfinite(summary: dict[str, Any], shown: int = _read.SHOWN) -> str | None:
  """The last recorded non-finite step and its leaves (``"step 117: dense/kernel (inf)"``)."""
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
  """The saved reports under ``run_dir`` (recursively) as text; a bad file named with why."""
  parts = []
  for path in sorted(pathlib.Path(run_dir).rglob(_read.LOCATE_NAME)):
    try:
      data = json.loads(path.read_text(encoding="utf-8"))
      shown = str(_headroom.LocateReport.from_dict(data))
    except (OSError, ValueError, TypeError, KeyError) as e:
      parts.append(f"{path}: not a locate report ({type(e).__name__}: {e})")
      continue
    step = f" (the batch of step {data['step']})" if "step" in data else ""
    parts.append(f"{path}{step}:\n{shown}")
  return "\n".join(parts)


# (column, axis label, y scale): a panel for each that some run logs, in this order.
_PANELS = (
  ("loss_scale", "loss scale", "log2"),
  ("loss", "loss", "linear"),
  ("grad_norm", "grad norm", "log"),
  ("skip_count", "skipped updates\n(cumulative)", "linear"),
  ("recomputed_steps", "recomputed steps\n(cumulative)", "linear"),
  ("underflow/zero_frac", "zero gradient\nentries (share)", "linear"),
)


def _matplotlib(module: str) -> Any:
  return _optional.require(module, "drawing the plot (--plot)")


def check_path(path: str) -> str | None:
  """Why ``path`` cannot take the plot (a missing folder, an unknown extension), or None."""
  canvas = _matplotlib("matplotlib.backend_bases").FigureCanvasBase
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    return f"the folder {os.path.dirname(path) or folder!r} does not exist"
  ext = os.path.splitext(path)[1].lstrip(".").lower()
  kinds = canvas.get_supported_filetypes()
  if ext not in kinds:
    return (
      f"unsupported image extension {ext or '(none)'!r} in {path!r}; "
      f"use one of {', '.join(sorted(kinds))}"
    )
  return None


def _values(rows: _read.Rows, key: str) -> np.ndarray:
  """The column drawn in the panel of ``key`` (the skips as the summary counts them)."""
  x = _diagnosis.skips(rows) if key == "skip_count" else _diagnosis.column(rows, key)
  return np.where(np.isfinite(x), x, np.nan)  # a gap where a value is missing or not finite


def _rises(x: np.ndarray) -> np.ndarray:
  """Rows at which the cumulative counter ``x`` went up since the row before."""
  with np.errstate(invalid="ignore"):
    return np.concatenate([[False], np.diff(x) > 0])


def plot(runs: dict[str, _read.Rows], out: str) -> None:
  """Draws each logged quantity of ``runs`` over the steps, skips and recomputes marked."""
  _matplotlib("matplotlib").use("Agg")
  plt = _matplotlib("matplotlib.pyplot")
  line2d = _matplotlib("matplotlib.lines").Line2D
  panels = [p for p in _PANELS if any(np.isfinite(_values(r, p[0])).any() for r in runs.values())]
  panels = panels or list(_PANELS[:1])
  fig, axes = plt.subplots(
    len(panels), 1, sharex=True, squeeze=False, layout="constrained",
    figsize=(10, 1.0 + 1.9 * len(panels)),
  )  # fmt: skip
  axes = axes[:, 0]
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  handles = []
  for i, (name, rows) in enumerate(runs.items()):
    color, steps = colors[i % len(colors)], _diagnosis.column(rows, "step")
    for ax, (key, _, _) in zip(axes, panels):
      ax.step(steps, _values(rows, key), where="post", color=color, label=name, lw=1.2)
    handles.append(axes[0].lines[-1])
    scale = _values(rows, "loss_scale")
    skipped = (_diagnosis.flag(rows, "skipped") > 0) | _rises(_diagnosis.skips(rows))
    recomputed = _rises(_diagnosis.column(rows, "recomputed_steps"))
    for marks, style, what in ((skipped, "x", "skipped"), (recomputed, "o", "recomputed")):
      axes[0].plot(
        steps[marks], scale[marks], style, color=color, mfc="none", ms=7, label=f"{name}: {what}"
      )
  for ax, (_, label, yscale) in zip(axes, panels):
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if yscale != "linear":
      ax.set_yscale("log", **({"base": 2} if yscale == "log2" else {}))
    elif "cumulative" in label:
      ax.yaxis.set_major_locator(_matplotlib("matplotlib.ticker").MaxNLocator(integer=True))
  axes[-1].set_xlabel("step")
  handles += [
    line2d([], [], ls="", marker="x", color="k", label="skipped step"),
    line2d([], [], ls="", marker="o", mfc="none", color="k", label="recomputed step"),
  ]
  fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 6))
  fig.savefig(out, dpi=110)
  plt.close(fig)
