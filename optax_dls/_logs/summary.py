"""The summary numbers of one run's logged rows: steps, updates, skips, scales; ``None``
where the logged columns do not tell (see :mod:`optax_dls._logs.columns`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from optax_dls._logs import columns as C
from optax_dls._util import locate_report as _headroom

Rows = C.Rows

scale_text = _headroom.power_text  # a loss scale as 2^k


def _counts(rows: Rows, iv: C.Intervals) -> dict[str, Any]:
  """Updates, skips, update ratio and longest streak; None where the columns do not tell."""
  steps = C.column(rows, "step")
  num_steps = C.counter(C.column(rows, "num_steps"))
  updates: float | None = C.last_known(num_steps)
  if np.isnan(num_steps).all():  # no num_steps column: one update per step
    updates = steps[-1] - steps[0] + 1
  skips = C.last_known(C.skips(rows))
  ratio = C.last_known(C.column(rows, "update_ratio"))
  if skips is not None and updates and (np.isfinite(num_steps).any() or ratio is None):
    ratio = (updates - skips) / updates  # exact from the counters
  consec = C.counter(C.column(rows, "consecutive_skips"))
  flags = C.flag(rows, "skipped")
  streak = None
  if np.isfinite(consec).any():
    streak = int(np.nanmax(consec))
  elif C.every_update_logged(iv) and np.isfinite(flags).all():
    runs = np.diff(np.flatnonzero(np.concatenate([[True], flags == 0, [True]]))) - 1
    streak = int(runs.max())
  if streak == 0 and skips:  # a skip between two logged rows
    streak = 1
  return {
    "updates": None if updates is None else int(updates),
    "applied_updates": None if updates is None or skips is None else int(updates - skips),
    "skips": None if skips is None else int(skips),
    "update_ratio": ratio,
    "longest_skip_streak": streak,
  }


def summarize(rows: Rows) -> dict[str, Any]:
  """Summary numbers of one run's rows (at least one, sorted by step).

  ``updates`` (``num_steps``, skipped ones included), ``applied_updates``, ``skips``,
  ``update_ratio``, ``longest_skip_streak`` (the longest seen in the logged rows) and
  ``fp32_fallback_steps`` are None where the columns do not tell. ``scale_min`` /
  ``scale_median`` (the lower median, a logged value) / ``scale_max``,
  ``steps_at_min_scale`` / ``steps_at_max_scale`` and ``scale_increases`` are over the
  logged scales. Where the rows carry them: ``overflows_by_group`` and ``nonfinite``.
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
      scale_median=float(np.sort(s)[(s.size - 1) // 2]),
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


def _update_number(value: Any) -> int | None:
  """A logged ``nonfinite_step`` as an int > 0, or None (none yet, or malformed)."""
  n = C.whole(value)
  return n if n is not None and n > 0 else None


def nonfinite(rows: Rows) -> dict[str, Any] | None:
  """Where the non-finite steps came from, as far as the rows record it; None without a
  ``nonfinite_step`` column.

  Returns ``{"numbering", "steps_seen", "steps_with_leaves", "by_parameter", "loss_steps",
  "last"}``: ``"step"`` numbering where ``step - num_steps`` is the same at every row, else
  ``"update"`` (update numbers from 1); the distinct non-finite steps; those recorded with
  their leaves; per leaf name ``{"name", "steps", "inf", "nan"}`` (most steps first); the
  steps whose loss was not finite; the last recorded ``{"step", "update", "leaves", "loss"}``.
  """
  if not C.present(rows, "nonfinite_step").any():
    return None
  d = C.column(rows, "step") - C.counter(C.column(rows, "num_steps"))
  d = d[np.isfinite(d)]
  offset = int(d[0]) if d.size and (d == d[0]).all() else None
  shift = offset or 0
  seen, loss, records = set(), set(), {}
  for row in rows:
    update = _update_number(row.get("nonfinite_step"))
    if update is None:
      continue
    seen.add(update)
    if C.number(row.get("nonfinite_loss")) > 0:
      loss.add(update)
    if isinstance(leaves := row.get("nonfinite_leaves"), dict):  # the later record wins
      records[update] = {str(k): "nan" if v == "nan" else "inf" for k, v in leaves.items()}
  counts: dict[str, dict[str, int]] = {}
  for leaves in records.values():
    for name, kind in leaves.items():
      counts.setdefault(name, {"inf": 0, "nan": 0})[kind] += 1
  by = [{"name": k, "steps": c["inf"] + c["nan"], **c} for k, c in counts.items()]
  last = max(records, default=None)
  return {
    "numbering": "update" if offset is None else "step",
    "steps_seen": len(seen),
    "steps_with_leaves": len(records),
    "by_parameter": sorted(by, key=lambda d: (-d["steps"], d["name"])),
    "loss_steps": [u + shift for u in sorted(loss)],
    "last": None
    if last is None
    else {"step": last + shift, "update": last, "leaves": records[last], "loss": last in loss},
  }


def overflows_by_group(rows: Rows) -> dict[str, int]:
  """``{label: the last logged overflows/<label>}``: the non-finite steps per group."""
  out = {}
  for key in sorted({k for r in rows for k in r if k.startswith("overflows/")}):
    if (value := C.last_known(C.counter(C.column(rows, key)))) is not None:
      out[key.removeprefix("overflows/")] = int(value)
  return out


def recent(rows: Rows, window: int = 100) -> dict[str, Any] | None:
  """Updates, skips and update ratio over about the last ``window`` (>= 1) updates, from the
  counters of the last row and of the latest row at least ``window`` updates before it (the
  first when none is); None where the counters do not tell."""
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
