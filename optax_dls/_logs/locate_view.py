"""The saved :func:`optax_dls.locate` report of a run folder, as ``optax-dls inspect`` shows it."""

from __future__ import annotations

import json
import os
import pathlib

from optax_dls._util import locate_report as _headroom

LOCATE_NAME = "locate.json"  # as optax_dls.writers.LOCATE_NAME


def saved_text(run_dir: str | os.PathLike) -> str:
  """The saved reports under ``run_dir`` (searched recursively), as text; ``""`` when none.
  A file that is not a report is named with the reason instead."""
  parts = []
  for path in sorted(pathlib.Path(run_dir).rglob(LOCATE_NAME)):
    try:
      data = json.loads(path.read_text(encoding="utf-8"))
      text = str(_headroom.LocateReport.from_dict(data))
    except (OSError, ValueError, TypeError, KeyError) as e:
      parts.append(f"{path}: not a locate report ({type(e).__name__}: {e})")
      continue
    step = f" (the batch of step {data['step']})" if "step" in data else ""
    parts.append(f"{path}{step}:\n{text}")
  return "\n".join(parts)
