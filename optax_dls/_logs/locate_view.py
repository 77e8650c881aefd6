"""The saved :func:`optax_dls.locate` report of a run folder, as ``optax-dls inspect`` shows it."""

from __future__ import annotations

import json
import os
import pathlib

from optax_dls._logs.summary import scale_text
from optax_dls._util import locate_report as _headroom

LOCATE_NAME = "locate.json"  # as optax_dls.writers.LOCATE_NAME
_ROWS = 10  # scopes shown


def report_text(report: _headroom.LocateReport) -> str:
  """``report`` as a table: the scale as a power of two, each scope's whole name (the column
  as wide as the longest), the nearest :data:`_ROWS` scopes; the headroom of the code outside
  any scope is not a row."""
  lines = [f"locate at loss scale {scale_text(report.scale)}:"]
  f = report.first
  if f is None:
    lines.append("  every value finite")
  else:
    lines.append(
      f"  first {f.kind}: {f.phase} {f.primitive} ({f.dtype}) in {f.scope or '(top level)'}"
      f" at {f.source}; largest finite input {f.input_max:.3g}"
    )
    lines += [f"  note: {f.note}"] if f.note else []
  rows = [h for h in report.headroom if h.scope != "(top level)"]
  width = max([len("scope"), *(len(h.scope) for h in rows[:_ROWS])])
  lines.append(f"  {'scope':<{width}}  {'forward':>9} {'backward':>9} {'subnormal':>9}")
  for h in rows[:_ROWS]:
    fwd = "overflow" if h.forward_overflow else f"{h.forward_fraction:.2%}"
    bwd = "overflow" if h.backward_overflow else f"{h.backward_fraction:.2%}"
    lines.append(f"  {h.scope:<{width}}  {fwd:>9} {bwd:>9} {h.underflow_share:>9.1%}")
  if len(rows) > _ROWS:
    lines.append(f"  ... {len(rows) - _ROWS} more scopes")
  return "\n".join(lines)


def saved_text(run_dir: str | os.PathLike) -> str:
  """The saved reports under ``run_dir`` (searched recursively), as text; ``""`` when none.
  A file that is not a report is named with the reason instead."""
  parts = []
  for path in sorted(pathlib.Path(run_dir).rglob(LOCATE_NAME)):
    try:
      data = json.loads(path.read_text(encoding="utf-8"))
      text = report_text(_headroom.LocateReport.from_dict(data))
    except (OSError, ValueError, TypeError, KeyError) as e:
      parts.append(f"{path}: not a locate report ({type(e).__name__}: {e})")
      continue
    step = f" (the batch of step {data['step']})" if "step" in data else ""
    parts.append(f"{path}{step}:\n{text}")
  return "\n".join(parts)
