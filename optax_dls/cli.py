"""``optax-dls inspect RUN_DIR``: summarise and diagnose a run's loss-scale logs.

Reads the ``metrics.jsonl`` files written by :class:`optax_dls.writers.MetricsWriter`
(or any JSON lines with a ``step`` key and the keys of :func:`optax_dls.metrics`)
and, where there are none, TensorBoard event files. Prints per run: steps,
updates, skips, update ratio, longest logged skip streak, the lowest / median /
highest logged loss scale (exact powers of two as ``2^k``), the logged steps at
the lowest and highest scale, then a diagnosis of the usual symptoms with what
to do about each. ``--plot out.png`` draws the loss scale and the skips.

The logs may be written every ``k`` steps. The diagnosis then rests on the
cumulative counters of the logged rows (``num_steps``, ``skip_count``, or
``update_ratio``) and on the loss scale at each logged row: what happened
between two rows is bounded, not guessed, and a problem is reported only where
the logged rows prove it, so a sparser log may show less but never something
false. The bounds take a growth to double the scale and a skip to halve it at
most, as the defaults of every built-in dynamic rule and compatibility preset
do; where the logged scales show another rule (a ratio that is not a power of
two, or a drop of more octaves than skips, as ``amax_policy``'s), only the
counters are used. A column that is missing is unknown: the diagnoses that
need it are not made. Without ``num_steps``, each step is taken to be one
update. Rows logged twice for one step (a resumed run) are merged, the later
values winning.

Lines that are not JSON objects with a ``step``, rows whose ``step`` is not a
whole number, corrupt TensorBoard records and unreadable files are skipped,
each on its own, and counted in a warning on stderr.

Exit codes: 0 success; 1 the output was closed early (e.g. ``| head``); 2 no
logs found, only unreadable logs, or a bad argument (e.g. ``--plot`` into a
missing folder or with an unknown extension).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from optax_dls import writers

_KEYS = (
  "loss_scale",
  "skipped",
  "skip_count",
  "consecutive_skips",
  "num_steps",
  "update_ratio",
  "grad_norm",
  "fp32_fallback",
  "loss",
)

# Diagnosis thresholds.
OVERFLOW_RATE = 0.01  # provable excess skips per update, second half of the logged rows
NO_GROWTH_UPDATES = 1000  # updates proven without any growth before "never grows"
ZERO_RISE = 0.10  # rise of the share of exactly-zero unscaled gradients over the run
STUCK_MIN_SKIPS = 3  # steps proven skipped at a loss scale <= 1
DIVERGE_FACTOR = 1.5  # last-tenth mean loss over first-tenth mean loss
_SHOWN = 5  # line numbers / offsets listed in a warning


class NoLogsError(Exception):
  """No metrics logs under the run folder."""


# --- Reading -------------------------------------------------------------------------------------


def _canonical(key: str) -> str:
  """Maps tags such as ``train/loss_scale`` or ``optax_dls/underflow/zero_frac`` to our keys."""
  if "underflow/" in key:
    return key[key.index("underflow/") :]
  for k in _KEYS:
    if key == k or key.endswith("/" + k):
      return k
  return key


def _train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rows with loss-scale metrics (e.g. not validation rows), or all if none has them."""
  kept = [r for r in rows if "loss_scale" in r or "skipped" in r]
  return kept or rows


def _merge_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per step, sorted by step; a step logged twice keeps the later values."""
  by_step: dict[int, dict[str, Any]] = {}
  for row in rows:
    by_step.setdefault(row["step"], {}).update(row)
  return [by_step[s] for s in sorted(by_step)]


def _step(value: Any) -> int | None:
  """A row's step as an int, or None when it is not a whole finite number (a malformed row)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
    return None
  return int(value) if abs(value) < 2**63 else None


def _warn(path: str, what: str) -> None:
  print(f"optax-dls inspect: warning: {path}: {what}", file=sys.stderr)


def _listing(where: list[int], unit: str) -> str:
  shown = ", ".join(str(w) for w in where[:_SHOWN])
  return f"{unit} {shown}{', ...' if len(where) > _SHOWN else ''}"


def _read(path: str, kind: str) -> list[dict[str, Any]]:
  """The well-formed rows of one log file (``kind`` "jsonl" or "events"); warns about the rest."""
  bad: list[int] = []
  try:
    if kind == "jsonl":
      raw = writers.read_jsonl(path, on_bad_line=lambda line, why: bad.append(line))
    else:
      raw = writers.read_tensorboard(path, on_bad_record=lambda offset, why: bad.append(offset))
  except Exception as e:  # noqa: BLE001  (OSError, or anything a foreign file may raise)
    _warn(path, f"unreadable ({type(e).__name__}: {e})")
    return []
  if bad and kind == "jsonl":
    _warn(
      path,
      f"skipped {len(bad)} line(s) that are not JSON objects with a 'step' "
      f"({_listing(bad, 'line')})",
    )
  elif bad:
    _warn(path, f"skipped {len(bad)} corrupt record(s) ({_listing(bad, 'at byte')})")
  rows, malformed = [], 0
  for row in raw:
    step = _step(row.get("step"))
    if step is None:
      malformed += 1
      continue
    rows.append({**row, "step": step})
  if malformed:
    _warn(path, f"skipped {malformed} row(s) whose 'step' is not a whole number")
  return rows


def _log_files(run_dir: str) -> list[tuple[str, str]]:
  """``[(path, kind)]``: the JSONL files under ``run_dir``, or its event files if there are none."""
  jsonl, events = [], []
  for root, _, files in os.walk(run_dir):
    for name in files:
      if name.endswith(".jsonl"):
        jsonl.append(os.path.join(root, name))
      elif name.startswith("events.out.tfevents"):
        events.append(os.path.join(root, name))
  return [(p, "jsonl") for p in sorted(jsonl)] or [(p, "events") for p in sorted(events)]


def load_runs(run_dir: str) -> dict[str, list[dict[str, Any]]]:
  """``{run name: rows sorted by step}`` from the JSONL files under ``run_dir``, or,
  where there are none, from its TensorBoard event files.

  A run is named by the rows' ``run`` key (a string), else by its folder.
  Rows without loss-scale keys (validation rows) are dropped when a run has
  others; rows of one step are merged, the later values winning. Bad lines,
  corrupt records, malformed rows and unreadable files are skipped with a
  warning on stderr.

  Raises:
    NoLogsError: ``run_dir`` is missing, holds no logs, or only unreadable ones.
    TypeError: ``run_dir`` is not a str or ``os.PathLike``.
  """
  run_dir = writers._check_path("run_dir", run_dir)
  if not os.path.isdir(run_dir):
    raise NoLogsError(f"{run_dir!r} is not a folder.")
  files = _log_files(run_dir)
  runs: dict[str, list[dict[str, Any]]] = {}
  top = os.path.basename(os.path.abspath(run_dir))
  for path, kind in files:
    folder = os.path.relpath(os.path.dirname(path), run_dir)
    for row in _read(path, kind):
      row = {_canonical(k): v for k, v in row.items()}
      name = row.get("run")
      name = name if isinstance(name, str) else (folder if folder != "." else top)
      runs.setdefault(name, []).append(row)
  runs = {k: _merge_steps(_train_rows(v)) for k, v in runs.items() if v}
  if not runs and files:
    raise NoLogsError(
      f"the logs under {run_dir!r} exist but are unreadable: none of {len(files)} file(s) "
      f"({', '.join(p for p, _ in files[:3])}{', ...' if len(files) > 3 else ''}) holds a row "
      "with a whole-number 'step'."
    )
  if not runs:
    raise NoLogsError(
      f"no metrics logs under {run_dir!r}: expected *.jsonl files with a 'step' key "
      "(optax_dls.writers.MetricsWriter) or TensorBoard event files (events.out.tfevents.*)."
    )
  return runs


# --- Columns and counters -----------------------------------------------------------------------


def _number(value: Any) -> float:
  """``value`` as a float; NaN (unknown) for a missing or malformed value."""
  if not isinstance(value, (int, float)):
    return np.nan  # missing, a string, list, null, ...
  try:
    return float(value)
  except OverflowError:  # an integer beyond float range
    return np.nan


def _column(rows: list[dict[str, Any]], key: str) -> np.ndarray:
  """The column ``key`` as float64, NaN where a row lacks it (unknown)."""
  return np.array([_number(r.get(key)) for r in rows], dtype=np.float64)


def _counter(x: np.ndarray) -> np.ndarray:
  """A cumulative counter column: NaN where the value is not a whole number in [0, 2**53)."""
  ok = np.isfinite(x) & (x >= 0) & (x < 2.0**53)
  ok[ok] &= x[ok] == np.round(x[ok])
  return np.where(ok, x, np.nan)


def _updates(rows: list[dict[str, Any]]) -> np.ndarray:
  """Updates done at each row: ``num_steps``; without that column, the step (one update per step)."""
  n = _counter(_column(rows, "num_steps"))
  if np.isnan(n).all():
    return _column(rows, "step")
  return n


def _skips(rows: list[dict[str, Any]]) -> np.ndarray:
  """Skipped updates done at each row: ``skip_count``, else ``num_steps * (1 - update_ratio)``.

  The ratio is a float32: it gives the count exactly only below 2**22 updates.
  """
  s = _counter(_column(rows, "skip_count"))
  ratio = _column(rows, "update_ratio")
  n_logged = _counter(_column(rows, "num_steps"))
  with np.errstate(invalid="ignore"):
    derived = n_logged * (1.0 - ratio)
    exact = (
      (n_logged < 2.0**22)
      & (derived > -0.25)
      & (derived < n_logged + 0.25)
      & (np.abs(derived - np.round(derived)) < 0.25)
    )
  return np.where(np.isnan(s) & exact, np.round(derived), s)


def _flag(rows: list[dict[str, Any]], key: str) -> np.ndarray:
  """A bool column as 1.0 / 0.0, NaN where unknown."""
  x = _column(rows, key)
  return np.where(np.isfinite(x), (x > 0).astype(np.float64), np.nan)


class _Intervals(NamedTuple):
  """What the counters prove between each logged row and the next (index i: rows i -> i + 1).

  ``known``: both rows carry consistent counters. ``dn``, ``ds``: updates and
  skips in the interval. ``octaves``: log2 of the scale ratio (NaN unknown).
  ``factor_two``: the logged scales follow the rule "a growth doubles the
  scale, only a skip lowers it, by one octave at most" as far as the rows
  show (every ratio a power of two, no drop of more octaves than skips).
  ``growth_ub``: an upper bound on the growths in the interval: the clean
  updates, and under that rule also skips + octaves. ``excess``: ``ds -
  growth_ub``, a lower bound on the skips that no growth in the interval
  explains.
  """

  known: np.ndarray
  dn: np.ndarray
  ds: np.ndarray
  octaves: np.ndarray
  factor_two: bool
  growth_ub: np.ndarray
  excess: np.ndarray


def _follows_factor_two(octaves: np.ndarray, ds: np.ndarray, known: np.ndarray) -> bool:
  """Whether the logged scale moves only by whole octaves, and down by at most one per skip."""
  seen = np.isfinite(octaves)
  whole = np.all(np.abs(octaves[seen] - np.round(octaves[seen])) < 1e-6)
  both = seen & known
  return bool(whole and np.all(octaves[both] >= -ds[both] - 1e-6))


def _intervals(rows: list[dict[str, Any]]) -> _Intervals:
  n = _updates(rows)
  s = _skips(rows)
  scale = _column(rows, "loss_scale")
  dn, ds = np.diff(n), np.diff(s)
  log_scale = np.full(len(rows), np.nan)
  good = np.isfinite(scale) & (scale > 0)
  log_scale[good] = np.log2(scale[good])
  octaves = np.diff(log_scale)
  with np.errstate(invalid="ignore"):
    known = np.isfinite(dn) & np.isfinite(ds) & (ds >= 0) & (ds <= dn)
  dn, ds = np.where(known, dn, np.nan), np.where(known, ds, np.nan)
  factor_two = _follows_factor_two(octaves, ds, known)
  clean = dn - ds
  growth_ub = clean
  if factor_two:
    with np.errstate(invalid="ignore"):
      by_scale = np.clip(np.round(ds + octaves), 0, None)
    growth_ub = np.where(np.isfinite(octaves), np.minimum(clean, by_scale), clean)
  return _Intervals(known, dn, ds, octaves, factor_two, growth_ub, ds - growth_ub)


def _segments(known: np.ndarray, start: int = 0) -> list[range]:
  """Maximal runs of consecutive known intervals at index >= ``start``."""
  out, begin = [], None
  for i in range(start, len(known) + 1):
    if i < len(known) and known[i]:
      begin = i if begin is None else begin
    elif begin is not None:
      out.append(range(begin, i))
      begin = None
  return out


# --- Summary ------------------------------------------------------------------------------------


def _longest_true_run(flags: np.ndarray) -> int:
  best = cur = 0
  for f in flags:
    cur = cur + 1 if f else 0
    best = max(best, cur)
  return best


def _last_known(x: np.ndarray) -> float | None:
  finite = x[np.isfinite(x)]
  return float(finite[-1]) if finite.size else None


def _every_update_logged(iv: _Intervals) -> bool:
  return bool(iv.known.all() and (iv.dn <= 1).all())


def _counts(rows: list[dict[str, Any]], iv: _Intervals) -> dict[str, Any]:
  """Updates, skips, update ratio and longest streak; None where the logged columns do not tell."""
  steps = _column(rows, "step")
  num_steps = _counter(_column(rows, "num_steps"))
  updates = _last_known(num_steps)
  if np.isnan(num_steps).all():  # no num_steps column: one update per step
    updates = steps[-1] - steps[0] + 1
  skips = _last_known(_skips(rows))
  logged_ratio = _last_known(_column(rows, "update_ratio"))
  if skips is not None and updates and (np.isfinite(num_steps).any() or logged_ratio is None):
    ratio = (updates - skips) / updates  # exact from the counters
  else:
    ratio = logged_ratio
  consec = _counter(_column(rows, "consecutive_skips"))
  flags = _flag(rows, "skipped")
  if np.isfinite(consec).any():
    streak = int(np.nanmax(consec))
  elif _every_update_logged(iv) and np.isfinite(flags).all():
    streak = _longest_true_run(flags > 0)
  else:
    streak = None
  return {
    "updates": None if updates is None else int(updates),
    "skips": None if skips is None else int(skips),
    "update_ratio": ratio,
    "longest_skip_streak": streak,
  }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Summary numbers of one run's rows (see the module docstring).

  ``updates``, ``skips``, ``update_ratio`` and ``longest_skip_streak`` are
  None where the logged columns do not tell. ``scale_min`` / ``scale_max``
  and ``steps_at_min_scale`` / ``steps_at_max_scale`` are the lowest and
  highest *logged* scales and the logged steps at them; ``scale_increases``
  counts the increases between consecutive logged rows. The streak is the
  longest one seen in the logged rows (a lower bound when not every update
  is logged, see ``every_update_logged``).
  """
  steps = _column(rows, "step")
  scale = _column(rows, "loss_scale")
  iv = _intervals(rows)
  out = {
    "logged_steps": len(rows),
    "first_step": int(steps[0]),
    "last_step": int(steps[-1]),
    "every_update_logged": _every_update_logged(iv),
    **_counts(rows, iv),
    "fp32_fallback_steps": int(np.nansum(_flag(rows, "fp32_fallback"))),
  }
  s = scale[np.isfinite(scale)]
  if s.size:
    out.update(
      scale_min=float(s.min()),
      scale_median=float(np.median(s)),
      scale_max=float(s.max()),
      steps_at_min_scale=int((s == s.min()).sum()),
      steps_at_max_scale=int((s == s.max()).sum()),
      scale_increases=int((np.diff(s) > 0).sum()),
    )
  return out


# --- Diagnosis ----------------------------------------------------------------------------------

# What to do about each symptom.
_ADVICE = {
  "frequent overflow": (
    "Gradients or activations overflow float16 again and again. Lower the learning rate or add "
    "warm-up, clip gradients (optax.clip_by_global_norm inside the loss-scaled optimizer), use "
    "hysteresis=2 to ride out isolated spikes, keep softmax / normalisation / loss in float32, or "
    "train in bfloat16."
  ),
  "scale never grows": (
    "Either growth_interval (or warmup_steps) is longer than the run, the scale started at "
    "max_scale, or overflows keep resetting the growth tracker. Shorten growth_interval "
    "(e.g. 1000), check warmup_steps, or raise max_scale."
  ),
  "gradients too small": (
    "Small gradients lose precision or vanish in float16 even at this loss scale. Raise "
    "init_scale and max_scale (optax_dls.config.preset('qlora') starts at 2**16), watch each "
    "parameter group with optax_dls.underflow_stats(labels) chained inside the loss-scaled "
    "optimizer, scale a small group's gradients with optax_dls.group_scale, or train in "
    "bfloat16."
  ),
  "gradients lost, no loss scaling": (
    "The run does not scale its loss, so float16 flushes small gradients to zero. Wrap the "
    "optimizer in optax_dls.dynamic_loss_scale and multiply the loss by "
    "optax_dls.scale_loss (or train in bfloat16)."
  ),
  "scale pinned": (
    "The gradients are small enough that the scale never overflows; if max_scale caps it, "
    "raise max_scale and chain optax_dls.underflow_stats() inside to see whether gradients "
    "underflow."
  ),
  "stuck at the minimum": (
    "Non-finite values even at the smallest scale come from the forward pass or the data, not "
    "from loss scaling: look for inf/NaN inputs or labels, run with jax_debug_nans, lower the "
    "learning rate, keep the loss and normalisation in float32, or turn on the float32 "
    "fallback (optax_dls.fp32_fallback(policy, after=10) with optax_dls.select_precision)."
  ),
  "diverging loss": (
    "Lower the peak learning rate or lengthen its warm-up, clip gradients, check the data "
    "order and the labels. Loss scaling skips non-finite steps, but it cannot undo finite "
    "updates that are too large."
  ),
}


def _scale_text(x: float) -> str:
  """A loss scale as ``2^k`` when it is an exact power of two other than 1, else in ``%g`` form.

  >>> from optax_dls.cli import _scale_text
  >>> _scale_text(2.0**21), _scale_text(2.0**-126), _scale_text(1.0), _scale_text(1500.0)
  ('2^21', '2^-126', '1', '1500')
  """
  if not (math.isfinite(x) and x > 0):
    return f"{x:g}"
  m, e = math.frexp(x)
  return f"2^{e - 1}" if m == 0.5 and e != 1 else f"{x:g}"


def _overflow_excess(rows: list[dict[str, Any]], iv: _Intervals) -> tuple[int, int, int, int]:
  """``(excess skips, updates, first step, last step)`` proven over the second half of the rows.

  Per run of consecutive known intervals, the first skip may still be the
  probe of a growth made before it, so one skip is given back per run.
  """
  steps = _column(rows, "step")
  excess = updates = 0
  first = last = None
  for seg in _segments(iv.known, start=len(rows) // 2):
    excess += max(int(np.sum(iv.excess[seg.start : seg.stop])) - 1, 0)
    updates += int(np.sum(iv.dn[seg.start : seg.stop]))
    first = int(steps[seg.start]) if first is None else first
    last = int(steps[seg.stop])
  return excess, updates, first, last


def _skips_at_scale_at_most_1(rows: list[dict[str, Any]], iv: _Intervals) -> int:
  """Skipped updates proven to have run at a loss scale <= 1.

  An interval that starts at scale S and holds at most g growths of one
  octave never runs above S * 2**g (without the factor-two rule: above S when
  g = 0); when that is <= 1, each of its skips ran at a scale <= 1.
  """
  scale = _column(rows, "loss_scale")[:-1]
  growths = iv.growth_ub if iv.factor_two else np.where(iv.growth_ub == 0, 0.0, np.inf)
  with np.errstate(invalid="ignore", over="ignore"):
    low = (
      iv.known & np.isfinite(scale) & (scale * np.exp2(np.nan_to_num(growths, nan=np.inf)) <= 1.0)
    )
  return int(np.sum(iv.ds[low]))


def _applied(rows: list[dict[str, Any]], iv: _Intervals) -> np.ndarray:
  """Rows whose own update is proven applied: ``skipped`` False, ``consecutive_skips`` 0, or no
  skip since the previous logged row."""
  flags = _flag(rows, "skipped")
  consec = _counter(_column(rows, "consecutive_skips"))
  clean_since = np.concatenate([[False], iv.known & (iv.ds == 0) & (iv.dn >= 1)])
  return (flags == 0) | (consec == 0) | clean_since


def _present(rows: list[dict[str, Any]], key: str) -> np.ndarray:
  """Whether each row has a number (NaN and inf included) under ``key``."""
  return np.array(
    [isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) for r in rows]
  )


_Found = list[tuple[str, str]]


def _frequent_overflow(rows: list[dict[str, Any]], iv: _Intervals, stuck: bool) -> _Found:
  excess, updates, first, last = _overflow_excess(rows, iv)
  if stuck or not updates or excess / updates <= OVERFLOW_RATE:
    return []
  symptom = (
    f"frequent overflow: at least {excess} of the {updates} updates from step {first} to step "
    f"{last} ({excess / updates:.1%}) were skipped beyond the one overflow per growth that "
    "dynamic scaling uses to probe"
  )
  return [(symptom, _ADVICE["frequent overflow"])]


def _never_grows(rows: list[dict[str, Any]], iv: _Intervals, summary: dict[str, Any]) -> _Found:
  if len(rows) < 2 or not iv.known.all() or (iv.growth_ub > 0).any():
    return []
  span = int(np.sum(iv.dn))
  if span < NO_GROWTH_UPDATES:
    return []
  cap = (
    f" (the scale stays at or below {_scale_text(summary['scale_max'])})"
    if "scale_max" in summary
    else ""
  )
  symptom = (
    f"scale never grows: no increase in the {span} updates from step {summary['first_step']} "
    f"to step {summary['last_step']}{cap}"
  )
  return [(symptom, _ADVICE["scale never grows"])]


def _zero_shares(rows: list[dict[str, Any]]) -> np.ndarray:
  zero = _column(rows, "underflow/zero_frac")
  return zero[np.isfinite(zero)]


def zero_floor(runs: dict[str, list[dict[str, Any]]]) -> tuple[str, float] | None:
  """``(run, median share of exactly-zero gradient entries)`` of the run with the lowest
  such share among ``runs`` (runs logged beside each other train the same model on the
  same data), or None when fewer than two runs logged it."""
  medians = {
    name: float(np.median(z)) for name, rows in runs.items() if len(z := _zero_shares(rows)) >= 4
  }
  if len(medians) < 2:
    return None
  name = min(medians, key=medians.get)
  return name, medians[name]


def _lost_gradients(
  rows: list[dict[str, Any]], summary: dict[str, Any], floor: tuple[str, float] | None = None
) -> _Found:
  """Gradient entries flushed to zero in float16 show up as exact zeros of the unscaled
  gradients. The logs prove lost signal when the share of zeros rises well above the
  run's own early level, or stays well above that of a run logged beside it (``floor``,
  see :func:`zero_floor`); a loss-scaled run keeps it at the floor. A high share of
  float16-subnormal unscaled entries proves nothing by itself: loss scaling lifts them."""
  zero = _column(rows, "underflow/zero_frac")
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
    elif late - early >= ZERO_RISE and late >= 2 * early:
      symptom = (
        f"gradients lost to underflow: the share of exactly-zero gradient entries rose from "
        f"{early:.1%} (first logged steps) to a median {late:.1%} ({since})"
      )
    if symptom:
      symptom += ", with no loss scaling" if unscaled else ""
      return [
        (symptom, _ADVICE["gradients lost, no loss scaling" if unscaled else "gradients too small"])
      ]
  at_max = summary.get("steps_at_max_scale", 0) / len(rows)
  # Overflows recomputed inside the step (optax_dls.value_and_grad) skip nothing but are overflows.
  recomputed = _last_known(_counter(_column(rows, "recompute_tries")))
  if (
    at_max > 0.5
    and summary.get("scale_max", 0) >= 2.0**24
    and summary["skips"] == 0
    and not recomputed
  ):
    symptom = (
      f"scale pinned at {_scale_text(summary['scale_max'])}, the highest logged, for "
      f"{at_max:.0%} of the logged steps, with no skipped step"
    )
    return [(symptom, _ADVICE["scale pinned"])]
  return []


def _stuck(count: int, summary: dict[str, Any]) -> _Found:
  if count < STUCK_MIN_SKIPS:
    return []
  symptom = (
    f"stuck at the minimum: at least {count} updates were skipped with the loss scale at or "
    f"below 1 (lowest logged {_scale_text(summary['scale_min'])})"
  )
  return [(symptom, _ADVICE["stuck at the minimum"])]


def _diverging(rows: list[dict[str, Any]], iv: _Intervals) -> _Found:
  loss, steps = _column(rows, "loss"), _column(rows, "step")
  applied = _applied(rows, iv) & _present(rows, "loss")
  if applied.sum() < 20:
    return []
  idx = np.flatnonzero(applied)
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


def diagnose(
  rows: list[dict[str, Any]], summary: dict[str, Any], zero_floor: tuple[str, float] | None = None
) -> list[tuple[str, str]]:
  """``[(symptom, what to do)]`` for the loss-scaling problems that ``rows`` prove;
  ``zero_floor`` (see :func:`zero_floor`) is what runs logged beside it prove."""
  iv = _intervals(rows)
  stuck = _skips_at_scale_at_most_1(rows, iv)
  return (
    _frequent_overflow(rows, iv, stuck >= STUCK_MIN_SKIPS)
    + _never_grows(rows, iv, summary)
    + _lost_gradients(rows, summary, zero_floor)
    + _stuck(stuck, summary)
    + _diverging(rows, iv)
  )


# --- Output -------------------------------------------------------------------------------------


def _or_unknown(value: Any, fmt: str = "{}") -> str:
  return "unknown" if value is None else fmt.format(value)


def _fmt(summary: dict[str, Any]) -> list[str]:
  streak = _or_unknown(summary["longest_skip_streak"])
  if summary["longest_skip_streak"] is not None and not summary["every_update_logged"]:
    streak = f"at least {streak}"  # a longer one may lie between two logged rows
  steps = (
    f"  steps        {summary['first_step']}..{summary['last_step']} "
    f"({summary['logged_steps']} logged, {_or_unknown(summary['updates'])} updates)"
  )
  skips = (
    f"  skips        {_or_unknown(summary['skips'])}  (update ratio "
    f"{_or_unknown(summary['update_ratio'], '{:.4f}')}, longest streak {streak})"
  )
  lines = [steps, skips]
  if "scale_min" in summary:
    lines.append(
      f"  loss scale   lowest {_scale_text(summary['scale_min'])} / median "
      f"{_scale_text(summary['scale_median'])} / highest {_scale_text(summary['scale_max'])} "
      "(logged)"
    )
    lines.append(
      f"  logged steps {summary['steps_at_min_scale']} at the lowest scale, "
      f"{summary['steps_at_max_scale']} at the highest"
    )
  if summary["fp32_fallback_steps"]:
    lines.append(f"  fp32 fallback on at {summary['fp32_fallback_steps']} logged steps")
  return lines


def plot(runs: dict[str, list[dict[str, Any]]], out: str) -> None:
  """Draws the loss scale (log2 axis, skipped steps marked) and the cumulative skips into ``out``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_s, ax_k) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
  for name, rows in runs.items():
    steps, scale = _column(rows, "step"), _column(rows, "loss_scale")
    skipped = _flag(rows, "skipped") > 0
    (line,) = ax_s.plot(steps, scale, label=name)
    ax_s.plot(steps[skipped], scale[skipped], "x", color=line.get_color())
    count = _skips(rows)
    if np.isfinite(count).any():
      ax_k.step(steps, count, where="post", label=name)
  ax_s.set_yscale("log", base=2)
  ax_s.set_ylabel("loss scale (x: skipped)")
  ax_k.set_ylabel("skipped steps (cumulative)")
  ax_k.set_xlabel("step")
  ax_s.legend(loc="best")
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)


def inspect(
  run_dir: str | os.PathLike, plot_path: str | os.PathLike | None = None, as_json: bool = False
) -> str:
  """The report printed by ``optax-dls inspect``.

  Args:
    run_dir: the folder with the logs (searched recursively).
    plot_path: optional image file to draw the loss scale and the skips into.
    as_json: bool, return the summary and diagnosis as JSON instead of text.

  Raises:
    NoLogsError: no readable logs under ``run_dir``.
    TypeError: ``run_dir`` or ``plot_path`` is not a path, or ``as_json`` not
      a bool.
  """
  if plot_path is not None:
    plot_path = writers._check_path("plot_path", plot_path)
  if not isinstance(as_json, (bool, np.bool_)):
    raise TypeError(f"as_json must be a bool, got {as_json!r} of type {type(as_json).__name__}.")
  runs = load_runs(run_dir)
  floor = zero_floor(runs)
  report = {}
  for name, rows in runs.items():
    summary = summarize(rows)
    found = diagnose(rows, summary, floor if floor and floor[0] != name else None)
    report[name] = {
      "summary": summary,
      "diagnosis": [{"symptom": s, "advice": a} for s, a in found],
    }
  if plot_path:
    plot(runs, plot_path)
  if as_json:
    return json.dumps(
      report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x
    )
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
    parser.error(
      f"argument --plot: unsupported image extension {ext or '(none)'!r} in {path!r}; "
      f"use one of {', '.join(sorted(kinds))}"
    )


def _print(text: str) -> int:
  """Prints ``text``; 0, or 1 when the reader closed the pipe (then stdout goes to devnull, so
  that the interpreter's final flush does not fail too, as the Python docs recommend)."""
  try:
    print(text)
    sys.stdout.flush()
  except BrokenPipeError:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``optax-dls`` command; returns the exit code."""
  parser = argparse.ArgumentParser(
    prog="optax-dls", description="Tools for optax_dls loss-scaled training runs."
  )
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("inspect", help="summarise and diagnose the loss-scale logs of a run folder")
  p.add_argument(
    "run_dir",
    help="folder with metrics.jsonl files or TensorBoard event files (searched recursively)",
  )
  p.add_argument(
    "--plot", metavar="OUT.png", help="also draw the loss scale and the skips into this image"
  )
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
  return _print(text)


if __name__ == "__main__":
  sys.exit(main())
