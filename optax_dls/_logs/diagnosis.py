"""One run's summary and the loss-scaling problems its rows prove, with what to do: what happened
between two logged rows is bounded, not guessed, so a sparse log shows less but nothing false."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from optax_dls._logs.read import Rows, whole
from optax_dls._util import locate_report as _headroom

_Found = list[tuple[str, str]]


def number(value: Any) -> float:
  """``value`` as a float; NaN (unknown) for a missing or malformed value."""
  try:
    return float(value) if isinstance(value, (int, float)) else np.nan
  except OverflowError:  # an integer beyond float range
    return np.nan


def column(rows: Rows, key: str) -> np.ndarray:
  return np.array([number(r.get(key)) for r in rows], dtype=np.float64)


def counter(x: np.ndarray) -> np.ndarray:
  """A cumulative counter column: NaN where the value is not a whole number in [0, 2**53)."""
  ok = np.isfinite(x) & (x >= 0) & (x < 2.0**53)
  ok[ok] &= x[ok] == np.round(x[ok])
  return np.where(ok, x, np.nan)


def updates(rows: Rows) -> np.ndarray:
  """Updates done at each row: ``num_steps``; without that column, the step."""
  n = counter(column(rows, "num_steps"))
  return column(rows, "step") if np.isnan(n).all() else n


def skips(rows: Rows) -> np.ndarray:
  """Skipped updates: ``skip_count``, else ``num_steps * (1 - update_ratio)`` where exact."""
  s = counter(column(rows, "skip_count"))
  n = counter(column(rows, "num_steps"))
  with np.errstate(invalid="ignore"):
    derived = n * (1.0 - column(rows, "update_ratio"))
    exact = (n < 2.0**22) & (np.abs(derived - n / 2) < n / 2 + 0.25)  # in (-0.25, n + 0.25)
    exact &= np.abs(derived - np.round(derived)) < 0.25
  return np.where(np.isnan(s) & exact, np.round(derived), s)


def flag(rows: Rows, key: str) -> np.ndarray:
  """A bool column as 1.0 / 0.0, NaN where unknown."""
  x = column(rows, key)
  return np.where(np.isfinite(x), (x > 0).astype(np.float64), np.nan)


def present(rows: Rows, key: str) -> np.ndarray:
  """Whether each row has a number (NaN and inf included, a bool not) under ``key``."""
  return np.array([type(r.get(key)) in (int, float) for r in rows], dtype=bool)


def last_known(x: np.ndarray) -> float | None:
  finite = x[np.isfinite(x)]
  return float(finite[-1]) if finite.size else None


class Intervals(NamedTuple):
  """What the counters prove between rows i and i + 1: ``dn`` updates, ``ds`` skips, ``octaves``
  of scale, at most ``growth_ub`` growths, ``excess`` skips; ``factor_two``: growths double."""

  known: np.ndarray
  dn: np.ndarray
  ds: np.ndarray
  octaves: np.ndarray
  factor_two: bool
  growth_ub: np.ndarray
  excess: np.ndarray


def intervals(rows: Rows) -> Intervals:
  """What the counters of consecutive rows prove (see :class:`Intervals`)."""
  scale = column(rows, "loss_scale")
  dn, ds = np.diff(updates(rows)), np.diff(skips(rows))
  log_scale = np.full(len(rows), np.nan)
  good = np.isfinite(scale) & (scale > 0)
  log_scale[good] = np.log2(scale[good])
  octaves = np.diff(log_scale)
  with np.errstate(invalid="ignore"):
    known = np.isfinite(dn) & np.isfinite(ds) & (ds >= 0) & (ds <= dn)
  dn, ds = np.where(known, dn, np.nan), np.where(known, ds, np.nan)
  seen, both = np.isfinite(octaves), np.isfinite(octaves) & known
  factor_two = bool(
    np.all(np.abs(octaves[seen] - np.round(octaves[seen])) < 1e-6)
    and np.all(octaves[both] >= -ds[both] - 1e-6)
  )
  growth_ub = dn - ds
  if factor_two:
    with np.errstate(invalid="ignore"):
      by_scale = np.clip(np.round(ds + octaves), 0, None)
    growth_ub = np.where(seen, np.minimum(growth_ub, by_scale), growth_ub)
  return Intervals(known, dn, ds, octaves, factor_two, growth_ub, ds - growth_ub)


def segments(known: np.ndarray, start: int = 0) -> list[range]:
  """Maximal runs of consecutive known intervals at index >= ``start``."""
  edges = start + np.flatnonzero(np.diff(np.concatenate([[0], known[start:], [0]]).astype(int)))
  return [range(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def every_update_logged(iv: Intervals) -> bool:
  """Whether the rows hold every update: all intervals known, none over one update."""
  return bool(iv.known.all() and (iv.dn <= 1).all())


scale_text = _headroom.power_text  # a loss scale as 2^k


def _counts(rows: Rows, iv: Intervals) -> dict[str, Any]:
  """Updates, skips, update ratio and longest streak; None where the columns do not tell."""
  steps = column(rows, "step")
  num_steps = counter(column(rows, "num_steps"))
  done: float | None = last_known(num_steps)
  if np.isnan(num_steps).all():  # no num_steps column: one update per step
    done = steps[-1] - steps[0] + 1
  skipped = last_known(skips(rows))
  ratio = last_known(column(rows, "update_ratio"))
  if skipped is not None and done and (np.isfinite(num_steps).any() or ratio is None):
    ratio = (done - skipped) / done  # exact from the counters
  consec = counter(column(rows, "consecutive_skips"))
  flags = flag(rows, "skipped")
  streak = None
  if np.isfinite(consec).any():
    streak = int(np.nanmax(consec))
  elif every_update_logged(iv) and np.isfinite(flags).all():
    runs = np.diff(np.flatnonzero(np.concatenate([[True], flags == 0, [True]]))) - 1
    streak = int(runs.max())
  if streak == 0 and skipped:  # a skip between two logged rows
    streak = 1
  return {
    "updates": None if done is None else int(done),
    "applied_updates": None if done is None or skipped is None else int(done - skipped),
    "skips": None if skipped is None else int(skipped),
    "update_ratio": ratio,
    "longest_skip_streak": streak,
  }


def summarize(rows: Rows) -> dict[str, Any]:
  """Summary numbers of one run's rows (at least one, sorted by step); None where unknown."""
  steps = column(rows, "step")
  scale = column(rows, "loss_scale")
  iv = intervals(rows)
  fallback = flag(rows, "fp32_fallback")  # the key appears only with the fp32 fallback
  out = {
    "logged_steps": len(rows),
    "first_step": int(steps[0]),
    "last_step": int(steps[-1]),
    "every_update_logged": every_update_logged(iv),
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
  groups = {}  # the last logged overflows/<label>: the non-finite steps per group
  for key in sorted({k for r in rows for k in r if k.startswith("overflows/")}):
    if (value := last_known(counter(column(rows, key)))) is not None:
      groups[key.removeprefix("overflows/")] = int(value)
  if groups:
    out["overflows_by_group"] = groups
  if (where := nonfinite(rows)) is not None:
    out["nonfinite"] = where
  return out


def nonfinite(rows: Rows) -> dict[str, Any] | None:
  """Where the non-finite steps came from (per leaf, the loss, the last), numbered by ``"step"``
  where ``step - num_steps`` is constant, else by ``"update"``; None without the column."""
  if not present(rows, "nonfinite_step").any():
    return None
  d = column(rows, "step") - counter(column(rows, "num_steps"))
  d = d[np.isfinite(d)]
  offset = int(d[0]) if d.size and (d == d[0]).all() else None
  shift = offset or 0
  seen, loss, records = set(), set(), {}
  for row in rows:
    update = whole(row.get("nonfinite_step"))  # none yet (0) or malformed: None
    if update is None or update <= 0:
      continue
    seen.add(update)
    if number(row.get("nonfinite_loss")) > 0:
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


def recent(rows: Rows, window: int = 100) -> dict[str, Any] | None:
  """Updates, skips and update ratio over about the last ``window`` updates; None if unknown."""
  n, s = updates(rows), skips(rows)
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


OVERFLOW_RATE = 0.01  # provable excess skips per update, second half of the logged rows
NO_GROWTH_UPDATES = 1000  # updates proven without any growth before "never grows"
ZERO_RISE = 0.10  # rise of the share of exactly-zero unscaled gradients over the run
STUCK_MIN_SKIPS = 3  # steps proven skipped at a loss scale <= 1
DIVERGE_FACTOR = 1.5  # last-tenth mean loss over first-tenth mean loss
_NAMED = 3  # parameters and steps named in a diagnosis

_T = "See docs/troubleshooting.md#"
_ADVICE = {
  "frequent overflow": "Lower the learning rate or add warm-up, clip gradients inside the "
  f"loss-scaled optimizer, or train in bfloat16. {_T}frequent-overflow.",
  "scale never grows": "Shorten growth_interval (e.g. 1000), check warmup_steps, or raise "
  f"max_scale. {_T}scale-never-grows.",
  "gradients too small": "Raise init_scale and max_scale (dynamic_loss_scale(..., "
  f"init_scale=2**16, max_scale=2**32)), or train in bfloat16. {_T}gradients-always-small.",
  "gradients lost, no loss scaling": "Wrap the optimizer in optax_dls.dynamic_loss_scale, "
  "multiply the loss by optax_dls.scale_loss (or train in bfloat16). "
  f"{_T}the-loss-was-not-multiplied.",
  "scale pinned": "If max_scale caps the scale, raise it; chain optax_dls.underflow_stats() "
  f"inside to see whether gradients underflow. {_T}gradients-always-small.",
  "stuck at the minimum": "Look for inf/NaN inputs or labels, run with jax_debug_nans, or turn "
  f"on optax_dls.fp32_fallback(policy, after=10). {_T}stuck-at-the-minimum.",
  "stuck at the minimum, fallback on": "Look for inf/NaN inputs or labels, or run with "
  f"jax_debug_nans: the float32 fallback did not end the skips. {_T}stuck-at-the-minimum.",
  "NaN skips": "No loss scale cures a NaN (0/0, log(0), inf - inf, bad data): "
  "optax_dls.locate(loss_fn, params, batch) on such a step names the operation; check the "
  f"data with optax_dls.all_finite(batch). {_T}where-a-step-failed.",
  "non-finite loss": "Check those steps' batches for inf/NaN inputs or labels "
  f"(optax_dls.all_finite(batch)) and keep the loss in float32. {_T}where-a-step-failed.",
  "diverging loss": "Lower the peak learning rate or lengthen its warm-up, clip gradients, "
  f"check the data order and the labels. {_T}training-diverges.",
}


def _frequent_overflow(rows: Rows, iv: Intervals, stuck: bool, summary: dict[str, Any]) -> _Found:
  """Excess skips over the second half of the rows, one given back per run of known intervals."""
  steps = column(rows, "step")
  excess = updates = 0
  first = last = None
  for seg in segments(iv.known, start=len(rows) // 2):
    excess += max(int(np.sum(iv.excess[seg.start : seg.stop])) - 1, 0)
    updates += int(np.sum(iv.dn[seg.start : seg.stop]))
    first = int(steps[seg.start]) if first is None else first
    last = int(steps[seg.stop])
  if stuck or not updates or excess / updates <= OVERFLOW_RATE:
    return []
  symptom = (
    f"frequent overflow: at least {excess} of the {updates} updates from step {first} to step "
    f"{last} ({excess / updates:.1%}) were skipped beyond the one overflow per growth that "
    "dynamic scaling uses to probe"
  )
  return [(symptom, where_advice(summary) + _ADVICE["frequent overflow"])]


def _skips_at_scale_at_most_1(rows: Rows, iv: Intervals) -> int:
  """Skips proven to have run at a scale <= 1 (from scale S, g growths reach S * 2**g)."""
  scale = column(rows, "loss_scale")[:-1]
  growths = iv.growth_ub if iv.factor_two else np.where(iv.growth_ub == 0, 0.0, np.inf)
  with np.errstate(invalid="ignore", over="ignore"):
    top = scale * np.exp2(np.nan_to_num(growths, nan=np.inf))
    low = iv.known & np.isfinite(scale) & (top <= 1.0)
  return int(np.sum(iv.ds[low]))


def _never_grows(rows: Rows, iv: Intervals, summary: dict[str, Any]) -> _Found:
  if len(rows) < 2 or not iv.known.all() or (iv.growth_ub > 0).any():
    return []
  span = int(np.sum(iv.dn))
  if span < NO_GROWTH_UPDATES:
    return []
  cap = ""
  if "scale_max" in summary:
    cap = f" (the scale stays at or below {scale_text(summary['scale_max'])})"
  symptom = (
    f"scale never grows: no increase in the {span} updates from step {summary['first_step']} "
    f"to step {summary['last_step']}{cap}"
  )
  return [(symptom, _ADVICE["scale never grows"])]


def zero_floor(runs: dict[str, Rows]) -> tuple[str, float] | None:
  """``(run, median zero share)`` of the run with the fewest zero gradients; None below two."""
  medians = {}
  for name, rows in runs.items():
    zero = column(rows, "underflow/zero_frac")
    if (zero := zero[np.isfinite(zero)]).size >= 4:
      medians[name] = float(np.median(zero))
  if len(medians) < 2:
    return None
  name = min(medians, key=medians.__getitem__)
  return name, medians[name]


def _lost_gradients(rows: Rows, summary: dict[str, Any], floor: tuple[str, float] | None) -> _Found:
  """Zero gradients rising above their early level or ``floor``, or the scale pinned at the top."""
  zero = column(rows, "underflow/zero_frac")
  known = np.flatnonzero(np.isfinite(zero))
  if len(known) >= 4:
    early = float(np.median(zero[known[: max(1, len(known) // 10)]]))
    late_rows = known[len(known) // 2 :]
    late = float(np.median(zero[late_rows]))
    since = f"logged steps from step {rows[late_rows[0]]['step']}"
    unscaled = summary.get("scale_max") == 1.0
    symptom = None
    if floor is not None and late - floor[1] >= ZERO_RISE:
      symptom = (
        f"gradients lost to underflow: a median {late:.1%} of the gradient entries are exactly "
        f"zero ({since}), against {floor[1]:.1%} in run {floor[0]!r} logged beside it"
      )
    elif late - early >= ZERO_RISE:
      symptom = (
        f"gradients lost to underflow: the share of exactly-zero gradient entries rose from "
        f"{early:.1%} (first logged steps) to a median {late:.1%} ({since})"
      )
    if symptom:
      advice = _ADVICE["gradients lost, no loss scaling" if unscaled else "gradients too small"]
      return [(symptom + (", with no loss scaling" if unscaled else ""), advice)]
  at_max = summary.get("steps_at_max_scale", 0) / len(rows)
  # Overflows recomputed inside the step (optax_dls.value_and_grad) skip nothing but are overflows.
  recomputed = last_known(counter(column(rows, "recompute_tries")))
  pinned = summary.get("scale_max", 0) >= 2.0**24 and summary["skips"] == 0
  if at_max > 0.5 and pinned and not recomputed:
    symptom = (
      f"scale pinned at {scale_text(summary['scale_max'])}, the highest logged, for "
      f"{at_max:.0%} of the logged steps, with no skipped step"
    )
    return [(symptom, _ADVICE["scale pinned"])]
  return []


def _stuck(count: int, summary: dict[str, Any]) -> _Found:
  if count < STUCK_MIN_SKIPS:
    return []
  symptom = (
    f"stuck at the minimum: at least {count} updates were skipped with the loss scale at or "
    f"below 1 (lowest logged {scale_text(summary['scale_min'])})"
  )
  on = summary.get("fp32_fallback_steps")  # None without the fallback in the logs
  advice = _ADVICE["stuck at the minimum, fallback on" if on else "stuck at the minimum"]
  return [(symptom, where_advice(summary, at_minimum=True) + advice)]


def _diverging(rows: Rows, iv: Intervals) -> _Found:
  """A loss rising or not finite over the rows whose own update is proven applied."""
  loss, steps = column(rows, "loss"), column(rows, "step")
  consec = counter(column(rows, "consecutive_skips"))
  clean_since = np.concatenate([[False], iv.known & (iv.ds == 0) & (iv.dn >= 1)])
  applied = (flag(rows, "skipped") == 0) | (consec == 0) | clean_since
  idx = np.flatnonzero(applied & present(rows, "loss"))
  if idx.size < 20:
    return []
  tenth = max(len(idx) // 10, 1)
  first, last = idx[:tenth], idx[-tenth:]
  bad = last[~np.isfinite(loss[last])]
  if bad.size:
    symptom = (
      f"diverging loss: non-finite loss on {bad.size} applied step(s) at the end of the run "
      f"(first at step {int(steps[bad[0]])})"
    )
  elif np.isfinite(loss[first]).all() and np.mean(loss[last]) > DIVERGE_FACTOR * abs(
    np.mean(loss[first])
  ):
    symptom = (
      f"diverging loss: the mean loss of the applied steps rose from {np.mean(loss[first]):.4g} "
      f"(steps {int(steps[first[0]])}..{int(steps[first[-1]])}) to {np.mean(loss[last]):.4g} "
      f"(steps {int(steps[last[0]])}..{int(steps[last[-1]])})"
    )
  else:
    return []
  return [(symptom, _ADVICE["diverging loss"])]


def _listing(items: list[Any], total: bool = False) -> str:
  shown = ", ".join(str(x) for x in items[:_NAMED])
  if len(items) <= _NAMED:
    return shown
  return shown + (f", ... ({len(items)} in all)" if total else f" and {len(items) - _NAMED} more")


def where_advice(summary: dict[str, Any], at_minimum: bool = False) -> str:
  """What the recorded non-finite values say of the parameters (NaN or inf); "" if none."""
  by = (summary.get("nonfinite") or {}).get("by_parameter") or []
  nan = [d["name"] for d in sorted((d for d in by if d["nan"]), key=lambda d: -d["nan"])]
  inf = [d["name"] for d in by if not d["nan"]]
  out = ""
  if nan:
    out += (
      f"The logged non-finite steps held NaN in {_listing(nan)}: an operation without a finite "
      "result (0/0, log(0), inf - inf) or bad data, which no loss scale fixes. "
    )
  if inf:
    out += f"{'Infinities only' if nan else 'The logged non-finite steps held infinities'} in "
    out += _listing(inf) + (
      ", at a scale of 1 or less: values that overflow float16 unscaled. "
      if at_minimum
      else ": their gradients outgrew float16 at the scale of the step; the scaler backs off by "
      "itself, so look at that layer only if it keeps happening. "
    )
  return out


def _loss_not_finite(summary: dict[str, Any]) -> _Found:
  where = summary.get("nonfinite")
  if not where or not (steps := where["loss_steps"]):
    return []
  unit = "step" if where["numbering"] == "step" else "update"
  symptom = (
    f"non-finite loss: the loss itself was not finite on {unit}{'s' * (len(steps) > 1)} "
    f"{_listing(steps, total=True)}: loss scaling "
    "cannot fix this, look at the data or the model"
  )
  return [(symptom, _ADVICE["non-finite loss"])]


def _nan_skips(summary: dict[str, Any]) -> _Found:
  """Skipped steps whose every recorded non-finite gradient held a NaN (no infinity)."""
  where = summary.get("nonfinite") or {}
  by = where.get("by_parameter") or []
  if not by or any(d["inf"] for d in by) or where["loss_steps"] or summary.get("skips") == 0:
    return []
  n = where["steps_with_leaves"]
  symptom = (
    f"NaN, not overflow: every one of the {n} non-finite step{'s' * (n > 1)} the logs record "
    f"held NaN in its gradients ({_listing([d['name'] for d in by])}) and none an infinity: "
    "a bug that no loss scale cures"
  )
  return [(symptom, _ADVICE["NaN skips"])]


def diagnose(
  rows: Rows, summary: dict[str, Any], zero_floor: tuple[str, float] | None = None
) -> list[tuple[str, str]]:
  """``[(symptom, what to do)]`` for the problems one run's ``rows`` prove."""
  iv = intervals(rows)
  stuck = _skips_at_scale_at_most_1(rows, iv)
  nan = _nan_skips(summary)  # then the skips are no overflow, however often they come
  overflow = [] if nan else _frequent_overflow(rows, iv, stuck >= STUCK_MIN_SKIPS, summary)
  found = _loss_not_finite(summary) + nan + overflow + _never_grows(rows, iv, summary)
  found += _lost_gradients(rows, summary, zero_floor) + _stuck(stuck, summary)
  return found + _diverging(rows, iv)
