"""Columns and counters of logged rows, and what the counters prove between two logged rows.

The rows are those :mod:`optax_dls._logs.read` reads: dicts with a whole-number
``step`` and the keys of :func:`optax_dls.metrics`. A missing or malformed
value is unknown (NaN), never a zero. Logs written every ``k`` steps hold the
cumulative counters (``num_steps``, ``skip_count``) at the logged rows only;
:func:`intervals` gives what they prove about the updates between two rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

Rows = list[dict[str, Any]]


def number(value: Any) -> float:
  """``value`` as a float; NaN (unknown) for a missing or malformed value."""
  if not isinstance(value, (int, float)):
    return np.nan  # missing, a string, list, null, ...
  try:
    return float(value)
  except OverflowError:  # an integer beyond float range
    return np.nan


def column(rows: Rows, key: str) -> np.ndarray:
  """The column ``key`` as float64, NaN where a row lacks it (unknown)."""
  return np.array([number(r.get(key)) for r in rows], dtype=np.float64)


def counter(x: np.ndarray) -> np.ndarray:
  """A cumulative counter column: NaN where the value is not a whole number in [0, 2**53)."""
  ok = np.isfinite(x) & (x >= 0) & (x < 2.0**53)
  ok[ok] &= x[ok] == np.round(x[ok])
  return np.where(ok, x, np.nan)


def updates(rows: Rows) -> np.ndarray:
  """Updates done at each row: ``num_steps``; without that column, the step (one per step)."""
  n = counter(column(rows, "num_steps"))
  if np.isnan(n).all():
    return column(rows, "step")
  return n


def skips(rows: Rows) -> np.ndarray:
  """Skipped updates done at each row: ``skip_count``, else ``num_steps * (1 - update_ratio)``.

  The ratio is a float32: it gives the count exactly only below 2**22 updates.
  """
  s = counter(column(rows, "skip_count"))
  ratio = column(rows, "update_ratio")
  n_logged = counter(column(rows, "num_steps"))
  with np.errstate(invalid="ignore"):
    derived = n_logged * (1.0 - ratio)
    exact = (
      (n_logged < 2.0**22)
      & (derived > -0.25)
      & (derived < n_logged + 0.25)
      & (np.abs(derived - np.round(derived)) < 0.25)
    )
  return np.where(np.isnan(s) & exact, np.round(derived), s)


def flag(rows: Rows, key: str) -> np.ndarray:
  """A bool column as 1.0 / 0.0, NaN where unknown."""
  x = column(rows, key)
  return np.where(np.isfinite(x), (x > 0).astype(np.float64), np.nan)


def present(rows: Rows, key: str) -> np.ndarray:
  """Whether each row has a number (NaN and inf included) under ``key``."""
  return np.array(
    [isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) for r in rows],
    dtype=bool,
  )


def last_known(x: np.ndarray) -> float | None:
  """The last finite value of ``x``, or None when it has none."""
  finite = x[np.isfinite(x)]
  return float(finite[-1]) if finite.size else None


class Intervals(NamedTuple):
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


def intervals(rows: Rows) -> Intervals:
  """What the counters of consecutive rows prove (see :class:`Intervals`)."""
  n = updates(rows)
  s = skips(rows)
  scale = column(rows, "loss_scale")
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
  return Intervals(known, dn, ds, octaves, factor_two, growth_ub, ds - growth_ub)


def segments(known: np.ndarray, start: int = 0) -> list[range]:
  """Maximal runs of consecutive known intervals at index >= ``start``."""
  out, begin = [], None
  for i in range(start, len(known) + 1):
    if i < len(known) and known[i]:
      begin = i if begin is None else begin
    elif begin is not None:
      out.append(range(begin, i))
      begin = None
  return out


def every_update_logged(iv: Intervals) -> bool:
  """Whether the rows hold every update: all intervals known and none longer than one update."""
  return bool(iv.known.all() and (iv.dn <= 1).all())
