"""``optax-dls inspect --plot``: each run's logged quantities, a panel each, with matplotlib."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from optax_dls._logs import columns as C
from optax_dls._util import optional as _optional

Rows = list[dict[str, Any]]

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
  """Why ``path`` cannot take the plot (a missing folder, an unknown extension), or None;
  MissingExtraError without matplotlib."""
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


def _values(rows: Rows, key: str) -> np.ndarray:
  """The column drawn in the panel of ``key`` (the skips as the summary counts them)."""
  x = C.skips(rows) if key == "skip_count" else C.column(rows, key)
  return np.where(np.isfinite(x), x, np.nan)  # a gap where a value is missing or not finite


def _rises(x: np.ndarray) -> np.ndarray:
  """Rows at which the cumulative counter ``x`` went up since the row before."""
  with np.errstate(invalid="ignore"):
    return np.concatenate([[False], np.diff(x) > 0])


def plot(runs: dict[str, Rows], out: str) -> None:
  """Draws each logged quantity of ``runs`` (``{name: rows}``) in a panel over a shared step
  axis into the image ``out``; skipped steps (the flag, or a rise of the skip count) marked
  with a cross on the scale, recomputed steps with a circle. OSError, MissingExtraError."""
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
    color, steps = colors[i % len(colors)], C.column(rows, "step")
    for ax, (key, _, _) in zip(axes, panels):
      # Values hold from one logged step to the next: drawn as steps, not ramps.
      ax.step(steps, _values(rows, key), where="post", color=color, label=name, lw=1.2)
    handles.append(axes[0].lines[-1])
    scale = _values(rows, "loss_scale")
    skipped = (C.flag(rows, "skipped") > 0) | _rises(C.skips(rows))
    recomputed = _rises(C.column(rows, "recomputed_steps"))
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
