"""Columns and counters of logged rows (a missing or malformed value unknown: NaN, never 0),
and what the cumulative counters prove between two logged rows (:func:`intervals`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

Rows = list[dict[str, Any]]


def whole(value: Any) -> int | None:
  """``value`` as an int when a whole finite number (not a bool) below 2**63 in size."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
    return None
  return int(value) if abs(value) < 2**63 else None


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
  """Skipped updates at each row: ``skip_count``, else ``num_steps * (1 - update_ratio)``
  where that float32 ratio gives it exactly (below 2**22 updates)."""
  s = counter(column(rows, "skip_count"))
  n = counter(column(rows, "num_steps"))
  with np.errstate(invalid="ignore"):
    derived = n * (1.0 - column(rows, "update_ratio"))
    exact = (
      (n < 2.0**22)
      & (derived > -0.25)
      & (derived < n + 0.25)
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
  finite = x[np.isfinite(x)]
  return float(finite[-1]) if finite.size else None


class Intervals(NamedTuple):
  """What the counters prove between each logged row and the next (index i: rows i -> i + 1).

  ``known``: both rows carry consistent counters; ``dn``, ``ds``: updates and skips in the
  interval; ``octaves``: log2 of the scale ratio (NaN unknown); ``factor_two``: the scales
  follow "a growth doubles, only a skip lowers, by one octave at most" as far as the rows
  show; ``growth_ub``: an upper bound on the growths (the clean updates, and under that rule
  also skips + octaves); ``excess``: ``ds - growth_ub``, skips no growth explains.
  """

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
  out, begin = [], None
  for i in range(start, len(known) + 1):
    if i < len(known) and known[i]:
      begin = i if begin is None else begin
    elif begin is not None:
      out.append(range(begin, i))
      begin = None
  return out


def every_update_logged(iv: Intervals) -> bool:
  """Whether the rows hold every update: all intervals known, none over one update."""
  return bool(iv.known.all() and (iv.dn <= 1).all())
