"""Outputs of the example: JSONL + TensorBoard per-step metrics, summary table, plot."""

from __future__ import annotations

import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboardX import SummaryWriter  # noqa: E402


def _clean(v):
  """JSON-safe scalar: Python float/int/bool; non-finite floats become null."""
  v = np.asarray(v).item()
  if isinstance(v, (bool, int)):
    return v
  v = float(v)
  return v if math.isfinite(v) else None


class MetricsLog:
  """Writes per-step records to ``metrics.jsonl`` and TensorBoard (``tb/<run>``).

  A ``train`` record per update and an ``eval`` record per validation pass;
  ``step`` counts the updates done (skipped ones included).
  """

  def __init__(self, out_dir: str):
    self.out_dir = out_dir
    self._jsonl = open(os.path.join(out_dir, "metrics.jsonl"), "w")
    self._tb = {}

  def write(self, run: str, kind: str, step: int, **values):
    rec = {"run": run, "kind": kind, "step": int(step)} | {k: _clean(v) for k, v in values.items()}
    self._jsonl.write(json.dumps(rec) + "\n")
    if run not in self._tb:
      self._tb[run] = SummaryWriter(os.path.join(self.out_dir, "tb", run))
    for k, v in values.items():  # non-finite values (grad_norm when skipped): JSONL only
      if k != "wall_s" and math.isfinite(float(v)):
        self._tb[run].add_scalar(f"{kind}/{k}", float(v), step)

  def close(self):
    self._jsonl.close()
    for w in self._tb.values():
      w.close()


def fmt_scale(s: float) -> str:
  """A loss scale as ``2^k`` when it is a power of two, else in ``%g`` form."""
  m, e = math.frexp(s)
  return f"2^{e - 1}" if m == 0.5 and e > 1 else f"{s:g}"


COLUMNS = ("run", "train loss", "val loss", "skipped", "update ratio", "loss scale", "wall s")


def table(results: dict) -> str:
  """The summary table, one row per run, as aligned text."""
  rows = [COLUMNS] + [
      (name, f"{r['train_loss']:.4f}", f"{r['val_loss']:.4f}", str(r["skipped"]),
       f"{r['update_ratio']:.3f}", fmt_scale(r["loss_scale"]), f"{r['wall_s']:.1f}")
      for name, r in results.items()]
  widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
  lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
  return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def diagnostic_table(points: list) -> str:
  """The gradient-signal diagnostic, one row per point of training."""
  head = ("step", "run S", "fp16 zeroed", "rel.err", "dlogits flushed",
          "dls S used", "dls zeroed", "rel.err", "dlogits flushed")
  rows = [head]
  for p in points:
    a, b = p["fp16"], p["fp16-dls"]
    used = fmt_scale(b["loss_scale"]) + (f" ({b['overflow_backoffs']} backoffs)" if b["overflow_backoffs"] else "")
    rows.append((str(p["step"]), fmt_scale(p["loss_scale"]),
                 f"{a['zeroed_fraction']:.3%}", f"{a['rel_error']:.2e}", f"{a['logit_grad_flushed']:.2%}",
                 used, f"{b['zeroed_fraction']:.3%}", f"{b['rel_error']:.2e}", f"{b['logit_grad_flushed']:.2%}"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
  k = max(1, min(k, len(y)))
  return np.convolve(y, np.ones(k) / k, mode="valid")


def plot(histories: dict, path: str, scaled_run: str = "fp16-dls", reference: str = "fp32") -> None:
  """Loss curves of every run, their gap to ``reference``, and the loss-scale trace (PNG).

  Args:
    histories: ``{run: {"step", "loss", "loss_scale", "skipped", "eval_step",
      "val_loss"}}`` of 1-D arrays; every run has the same data order, so
      per-step differences are like-for-like.
    path: where to write the PNG.
  """
  fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 9), sharex=True, height_ratios=(3, 2, 2))
  k = max(1, len(next(iter(histories.values()))["loss"]) // 50)
  ref = histories.get(reference)
  for i, (name, h) in enumerate(histories.items()):
    c = f"C{i}"
    ax1.plot(h["step"][k - 1:], _smooth(np.asarray(h["loss"], float), k), c, lw=1, label=f"{name} train")
    ax1.plot(h["eval_step"], h["val_loss"], "o--", color=c, ms=4, label=f"{name} validation")
    if ref is not None and name != reference:
      gap = np.asarray(h["loss"], float) - np.asarray(ref["loss"], float)
      ax2.plot(h["step"][k - 1:], _smooth(gap, k), c, lw=1, label=f"{name} - {reference}")
  ax1.set_ylabel("cross-entropy (nats/byte)")
  ax1.set_title(f"train loss: running mean over {k} steps", fontsize=9)
  ax1.legend(fontsize=8)
  ax2.axhline(0, color="k", lw=0.5)
  ax2.set_ylabel(f"train loss gap to {reference}")
  if ref is None:
    ax2.text(0.5, 0.5, f"no {reference} run", ha="center", transform=ax2.transAxes)
  else:
    ax2.legend(fontsize=8)
  h = histories.get(scaled_run)
  if h is not None:
    step, scale, skipped = (np.asarray(h[key]) for key in ("step", "loss_scale", "skipped"))
    ax3.step(step, scale, where="post", color="C2", label=f"{scaled_run} loss scale (after the step)")
    ax3.plot(step[skipped], scale[skipped], "rx", label=f"skipped steps ({int(skipped.sum())})")
    ax3.set_yscale("log", base=2)
    ax3.legend(fontsize=8)
  else:
    ax3.text(0.5, 0.5, f"no {scaled_run} run", ha="center", transform=ax3.transAxes)
  ax3.set_ylabel("loss scale S")
  ax3.set_xlabel("update")
  for ax in (ax1, ax2, ax3):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
