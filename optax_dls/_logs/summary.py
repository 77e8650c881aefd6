"""The summary numbers of one run's logged rows: steps, updates, skips, scales.

Every number is what the logged rows tell: ``None`` where the logged columns
do not (see :mod:`optax_dls._logs.columns`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from optax_dls._logs import columns as C
from optax_dls._util import locate_report as _headroom

Rows = C.Rows


scale_text = _headroom.power_text  # a loss scale as 2^k


def _longest_true_run(flags: np.ndarray) -> int:
  best = cur = 0
  for f in flags:
    cur = cur + 1 if f else 0
    best = max(best, cur)
  return best


def _counts(rows: Rows, iv: C.Intervals) -> dict[str, Any]:
  """Updates, skips, update ratio and longest streak; None where the logged columns do not tell."""
  steps = C.column(rows, "step")
  num_steps = C.counter(C.column(rows, "num_steps"))
  updates: float | None = C.last_known(num_steps)
  if np.isnan(num_steps).all():  # no num_steps column: one update per step
    updates = steps[-1] - steps[0] + 1
  skips = C.last_known(C.skips(rows))
  logged_ratio = C.last_known(C.column(rows, "update_ratio"))
  if skips is not None and updates and (np.isfinite(num_steps).any() or logged_ratio is None):
    ratio: float | None = (updates - skips) / updates  # exact from the counters
  else:
    ratio = logged_ratio
  consec = C.counter(C.column(rows, "consecutive_skips"))
  flags = C.flag(rows, "skipped")
  if np.isfinite(consec).any():
    streak = int(np.nanmax(consec))
  elif C.every_update_logged(iv) and np.isfinite(flags).all():
    streak = _longest_true_run(flags > 0)
  else:
    streak = None
  if streak is not None and streak == 0 and skips:  # a skip between two logged rows
    streak = 1
  return {
    "updates": None if updates is None else int(updates),
    "applied_updates": None if updates is None or skips is None else int(updates - skips),
    "skips": None if skips is None else int(skips),
    "update_ratio": ratio,
    "longest_skip_streak": streak,
  }


def summarize(rows: Rows) -> dict[str, Any]:
  """Summary numbers of one run's rows (see :mod:`optax_dls.cli`).

  ``updates`` counts the updates, skipped ones included (``num_steps``),
  ``applied_updates`` those applied, ``skips`` the skipped ones; these,
  ``update_ratio``, ``longest_skip_streak`` and ``fp32_fallback_steps`` (the
  logged steps with the float32 fallback on) are None where the logged
  columns do not tell. ``scale_min`` / ``scale_max`` and
  ``steps_at_min_scale`` / ``steps_at_max_scale`` are the lowest and highest
  *logged* scales and the logged steps at them; ``scale_median`` is the lower
  median of the logged scales, itself a logged value; ``scale_increases``
  counts the increases between consecutive logged rows. The streak is the
  longest one seen in the logged rows (a lower bound when not every update
  is logged, see ``every_update_logged``). Where the rows carry them:
  ``overflows_by_group`` (see :func:`overflows_by_group`) and ``nonfinite``
  (see :func:`nonfinite`).

  Args:
    rows: one run's rows, sorted by step, at least one.
  """
  steps = C.column(rows, "step")
  scale = C.column(rows, "loss_scale")
  iv = C.intervals(rows)
  fallback = C.flag(rows, "fp32_fallback")  # the key appears only with the fp32 fallback
  out = {
    "logged_steps": len(rows),
    "first_step": int(steps[0]),
    "last_step": int(steps[-1]),
    "every_update_logged": C.every_update_logged(iv),
    **_counts(rows, iv),
    "fp32_fallback_steps": int(np.nansum(fallback)) if np.isfinite(fallback).any() else None,
  }
  s = scale[np.isfinite(scale)]
  if s.size:
    out.update(
      scale_min=float(s.min()),
      scale_median=float(np.sort(s)[(s.size - 1) // 2]),  # a logged value
      scale_max=float(s.max()),
      steps_at_min_scale=int((s == s.min()).sum()),
      steps_at_max_scale=int((s == s.max()).sum()),
      scale_increases=int((np.diff(s) > 0).sum()),
    )
  if groups := overflows_by_group(rows):
    out["overflows_by_group"] = groups
  if (where := nonfinite(rows)) is not None:
    out["nonfinite"] = where
  return out


# --- Where the non-finite steps came from -------------------------------------------------------


def _update_number(value: Any) -> int | None:
  """A logged ``nonfinite_step`` as an int > 0, or None (no non-finite step yet, or malformed)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if not (math.isfinite(value) and value == int(value) and value > 0):
    return None
  return int(value)


def _step_offset(rows: Rows) -> int | None:
  """``step - num_steps`` when it is the same at every logged row that has both (one update per
  step), else None: then an update number cannot be told as a step."""
  d = C.column(rows, "step") - C.counter(C.column(rows, "num_steps"))
  d = d[np.isfinite(d)]
  return int(d[0]) if d.size and (d == d[0]).all() else None


def _records(rows: Rows) -> dict[int, dict[str, str]]:
  """``{update number: {leaf name: "inf" | "nan"}}`` of the non-finite steps logged with names;
  a step logged twice keeps the later record."""
  out = {}
  for row in rows:
    leaves, update = row.get("nonfinite_leaves"), _update_number(row.get("nonfinite_step"))
    if update is not None and isinstance(leaves, dict):
      out[update] = {str(k): "nan" if v == "nan" else "inf" for k, v in leaves.items()}
  return out


def _by_parameter(records: dict[int, dict[str, str]]) -> list[dict[str, Any]]:
  """Per leaf name: the recorded non-finite steps it was in, of them with NaN / inf only; most
  steps first."""
  counts: dict[str, dict[str, int]] = {}
  for leaves in records.values():
    for name, kind in leaves.items():
      c = counts.setdefault(name, {"inf": 0, "nan": 0})
      c[kind] += 1
  out = [{"name": k, "steps": c["inf"] + c["nan"], **c} for k, c in counts.items()]
  return sorted(out, key=lambda d: (-d["steps"], d["name"]))


def nonfinite(rows: Rows) -> dict[str, Any] | None:
  """Where the non-finite steps came from, as far as the rows record it; None without a
  ``nonfinite_step`` column.

  Returns:
    ``{"numbering": "step" | "update", "steps_seen", "steps_with_leaves", "by_parameter",
    "loss_steps", "last"}``: the distinct non-finite steps the rows name (by
    ``nonfinite_step``), those of them recorded with their leaves, per leaf
    name the count of those it was in (``{"name", "steps", "inf", "nan"}``,
    most first), the non-finite steps whose loss itself was not finite, and
    the last recorded one (``{"step", "update", "leaves", "loss"}``: ``update``
    the number ``metrics`` gives it as ``nonfinite_step``, or None). Steps
    are logged steps (``numbering`` "step") where ``step - num_steps`` is the
    same at every row, else update numbers counted from 1 (``numbering``
    "update").
  """
  if not C.present(rows, "nonfinite_step").any():
    return None
  offset = _step_offset(rows)
  shift = offset or 0
  seen, loss = set(), set()
  for row in rows:
    update = _update_number(row.get("nonfinite_step"))
    if update is not None:
      seen.add(update)
      if C.number(row.get("nonfinite_loss")) > 0:
        loss.add(update)
  records = _records(rows)
  last = max(records, default=None)
  return {
    "numbering": "update" if offset is None else "step",
    "steps_seen": len(seen),
    "steps_with_leaves": len(records),
    "by_parameter": _by_parameter(records),
    "loss_steps": [u + shift for u in sorted(loss)],
    "last": None
    if last is None
    else {"step": last + shift, "update": last, "leaves": records[last], "loss": last in loss},
  }


def overflows_by_group(rows: Rows) -> dict[str, int]:
  """``{label: count}``: the last logged ``overflows/<label>``, the non-finite steps in which some
  leaf of that parameter group was not finite."""
  labels = sorted({k for r in rows for k in r if k.startswith("overflows/")})
  out = {}
  for key in labels:
    value = C.last_known(C.counter(C.column(rows, key)))
    if value is not None:
      out[key.removeprefix("overflows/")] = int(value)
  return out


def recent(rows: Rows, window: int = 100) -> dict[str, Any] | None:
  """Updates, skips and update ratio over about the last ``window`` updates, from the counters of
  the last row and of the latest row at least ``window`` updates before it (the first row when
  none is); None where the counters do not tell.

  Args:
    rows: one run's rows, sorted by step.
    window: int >= 1, the updates to look back. Default 100.
  """
  n, s = C.updates(rows), C.skips(rows)
  known = np.flatnonzero(np.isfinite(n) & np.isfinite(s))
  if known.size < 2:
    return None
  last = known[-1]
  before = known[n[known] <= n[last] - window]
  first = before[-1] if before.size else known[0]
  dn, ds = int(n[last] - n[first]), int(s[last] - s[first])
  if dn <= 0 or not 0 <= ds <= dn:
    return None
  return {"updates": dn, "skips": ds, "update_ratio": (dn - ds) / dn}
