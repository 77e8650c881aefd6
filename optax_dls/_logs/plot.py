"""``optax-dls inspect --plot``: the loss scale and the skips of each run, drawn with matplotlib."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from optax_dls._logs import columns as C
from optax_dls._util import optional as _optional

Rows = list[dict[str, Any]]


def _matplotlib(module: str) -> Any:
  return _optional.require(module, "drawing the plot (--plot)")


def check_path(path: str) -> str | None:
  """Why ``path`` cannot take the plot (a missing folder, an unknown image extension), or None.

  Raises:
    MissingExtraError: matplotlib is not installed.
  """
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


def plot(runs: dict[str, Rows], out: str) -> None:
  """Draws the loss scale (log2 axis, skipped steps marked) and the cumulative skips into ``out``.

  Args:
    runs: ``{run name: rows sorted by step}``.
    out: the image file to write (its extension picks the format).

  Raises:
    OSError: ``out`` cannot be written.
    MissingExtraError: matplotlib is not installed.
  """
  _matplotlib("matplotlib").use("Agg")
  plt = _matplotlib("matplotlib.pyplot")

  fig, (ax_s, ax_k) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
  for name, rows in runs.items():
    steps, scale = C.column(rows, "step"), C.column(rows, "loss_scale")
    skipped = C.flag(rows, "skipped") > 0
    # The scale holds from one logged step to the next: drawn as steps, not ramps.
    (line,) = ax_s.step(steps, scale, where="post", label=name)
    ax_s.plot(steps[skipped], scale[skipped], "x", color=line.get_color())
    count = C.skips(rows)
    if np.isfinite(count).any():
      ax_k.step(steps, count, where="post", label=name)
  ax_s.set_yscale("log", base=2)
  ax_s.set_ylabel("loss scale (x: skipped)")
  ax_k.set_ylabel("skipped steps (cumulative)")
  ax_k.yaxis.set_major_locator(_matplotlib("matplotlib.ticker").MaxNLocator(integer=True))
  ax_k.set_xlabel("step")
  ax_s.legend(loc="best")
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)
