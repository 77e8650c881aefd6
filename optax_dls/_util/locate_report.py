"""The report :func:`optax_dls.locate` returns (no JAX here: ``_logs`` reads it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Operation:
  """One operation whose output was not finite.

  Attributes:
    phase: ``"forward"`` (computing ``S * fun(*args)``) or ``"backward"`` (its gradient).
    primitive: the JAX primitive, e.g. ``"dot_general"``.
    source: ``"file:line"`` of the user's code that wrote it (``"?"`` when unknown).
    scope: its named scope, block path (``"blocks/2"``) or else the user's function's name.
    kind: ``"inf"`` or ``"nan"`` (``"nan"`` when its output holds any NaN).
    dtype: its output's dtype, e.g. ``"float16"``.
    input_max: the largest finite ``|value|`` among its inputs (0.0 when none).
    note: why the place is approximate or where the value came from, else ``""``."""

  phase: str
  primitive: str
  source: str
  scope: str
  kind: str
  dtype: str
  input_max: float
  note: str = ""


@dataclasses.dataclass
class ScopeHeadroom:
  """How close one scope's values come to its dtype's limits.

  Attributes:
    scope: the scope's name (``"(top level)"`` outside any).
    forward_fraction / backward_fraction: the largest finite ``|activation|`` / ``|cotangent|`` over
      the dtype's largest finite value (entries at exactly that value, a mask's, left out).
    forward_overflow / backward_overflow: an operation made an inf or NaN from finite inputs.
    underflow_share: the share of its floating output entries that are subnormal."""

  scope: str
  forward_fraction: float = 0.0
  backward_fraction: float = 0.0
  forward_overflow: bool = False
  backward_overflow: bool = False
  underflow_share: float = 0.0
  first_overflow: int = -1  # order of its first overflowing operation; -1 when none
  _entries: int = dataclasses.field(default=0, repr=False)
  _below_normal: int = dataclasses.field(default=0, repr=False)

  def sort_key(self) -> tuple[int, int, float]:
    overflowed = self.forward_overflow or self.backward_overflow
    nearest = max(self.forward_fraction, self.backward_fraction)
    return (0 if overflowed else 1, self.first_overflow if overflowed else 0, -nearest)


@dataclasses.dataclass
class LocateReport:
  """What :func:`optax_dls.locate` found: the ``scale``, the ``first`` :class:`Operation` that made
  an inf or NaN (or ``None``), and a :class:`ScopeHeadroom` per scope, closest to overflow first."""

  scale: float
  first: Operation | None
  headroom: list[ScopeHeadroom]

  def to_dict(self) -> dict[str, Any]:
    """The report as plain JSON types (``json.dumps`` accepts it)."""
    shown = [f.name for f in dataclasses.fields(ScopeHeadroom) if f.repr]
    rows = [{k: _plain(getattr(h, k)) for k in shown} for h in self.headroom]
    first = None if self.first is None else dataclasses.asdict(self.first)
    return {"scale": float(self.scale), "first": first, "headroom": rows}

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> LocateReport:
    """The report :meth:`to_dict` gave (read back from a saved ``locate.json``)."""
    first = data.get("first")
    rows = [ScopeHeadroom(**row) for row in data.get("headroom", [])]
    return cls(float(data["scale"]), None if first is None else Operation(**first), rows)

  def nearest(self, n: int = 3) -> list[ScopeHeadroom]:
    """The ``n`` scopes closest to overflow."""
    return self.headroom[:n]

  def __str__(self) -> str:
    """A table: the scale as a power of two and the ten nearest scopes."""
    lines = [f"locate at loss scale {power_text(self.scale)}:"]
    f = self.first
    if f is None:
      lines.append("  every value finite")
    else:
      lines.append(
        f"  first {f.kind}: {f.phase} {f.primitive} ({f.dtype}) in {f.scope or '(top level)'}"
        f" at {f.source}; largest finite input {f.input_max:.3g}"
      )
      lines += [f"  note: {f.note}"] if f.note else []
    rows = [h for h in self.headroom if h.scope != "(top level)"]
    width = max([len("scope"), *(len(h.scope) for h in rows[:10])])
    lines.append(f"  {'scope':<{width}}  {'forward':>9} {'backward':>9} {'subnormal':>9}")
    for h in rows[:10]:
      fwd = "overflow" if h.forward_overflow else f"{h.forward_fraction:.2%}"
      bwd = "overflow" if h.backward_overflow else f"{h.backward_fraction:.2%}"
      lines.append(f"  {h.scope:<{width}}  {fwd:>9} {bwd:>9} {h.underflow_share:>9.1%}")
    if len(rows) > 10:
      lines.append(f"  ... {len(rows) - 10} more scopes")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
  return value.item() if isinstance(value, np.generic) else value


class Accumulator:
  """Collects each operation's outputs, per scope, as :func:`locate` evaluates them."""

  def __init__(self) -> None:
    self.scopes: dict[str, ScopeHeadroom] = {}
    self.first: Operation | None = None
    self.first_propagated: Operation | None = None
    self._order = 0

  def add(
    self, phase: str, scope: str, outputs: list[np.ndarray], ranged: bool, made: bool
  ) -> None:
    """Records one operation's float outputs: their range if ``ranged``, an overflow if ``made``."""
    h = self.scopes.setdefault(scope or "(top level)", ScopeHeadroom(scope or "(top level)"))
    if ranged:
      for out in outputs:
        info = np.finfo(out.dtype)
        values = np.abs(out.astype(np.float64))
        measured = np.isfinite(values) & (values != float(info.max))
        largest = float(values[measured].max()) if measured.any() else 0.0
        fraction = largest / float(info.max)
        setattr(h, f"{phase}_fraction", max(getattr(h, f"{phase}_fraction"), fraction))
        h._entries += values.size
        h._below_normal += int(np.count_nonzero((values > 0) & (values < float(info.tiny))))
        h.underflow_share = h._below_normal / max(h._entries, 1)
    if made:
      setattr(h, f"{phase}_overflow", True)
      if h.first_overflow < 0:
        h.first_overflow = self._order
      self._order += 1

  def report(self, scale: float) -> LocateReport:
    rows = sorted(self.scopes.values(), key=ScopeHeadroom.sort_key)
    return LocateReport(scale, self.first or self.first_propagated, rows)


def power_text(x: float) -> str:
  """A loss scale as ``2^k`` (1 as ``1``), else ``2^x.xx``; ``%g`` unless finite and > 0.

  >>> from optax_dls._util.locate_report import power_text
  >>> power_text(2.0**21), power_text(2.0**-126), power_text(1.0), power_text(1500.0)
  ('2^21', '2^-126', '1', '2^10.55')
  """
  if not (math.isfinite(x) and x > 0):
    return f"{x:g}"
  m, e = math.frexp(x)
  if m == 0.5:
    return "1" if e == 1 else f"2^{e - 1}"
  return f"2^{math.log2(x):.2f}"
