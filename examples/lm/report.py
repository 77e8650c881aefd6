"""Outputs of the example: the summary table and the plot."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def fmt_scale(s: float) -> str:
  """A loss scale as ``2^k`` when it is a power of two, else in ``%g`` form."""
  m, e = math.frexp(s)
  return f"2^{e - 1}" if m == 0.5 and e > 1 else f"{s:g}"


COLUMNS = (
  "run",
  "val loss",
  "vs fp32",
  "train loss",
  "zero grads",
  "skipped",
  "recomputed",
  "extra passes",
  "loss scale",
  "wall s",
)


def table(results: dict, reference: str = "fp32") -> str:
  """The summary table, one row per run, as aligned text.

  ``vs fp32`` is the relative difference of the validation loss to the
  ``reference`` run's (blank without one); ``zero grads`` the median share of
  zero parameter-gradient entries over the second half of the run;
  ``recomputed`` the steps recomputed after an overflow and ``extra passes``
  the forward and backward passes this cost, as a share of the run's
  (``-`` for a run that does not recompute: its row's values are None).
  """
  ref = results.get(reference)
  na = lambda x, fmt: "-" if x is None else fmt.format(x)
  rows = [COLUMNS] + [
    (
      name,
      f"{r['val_loss']:.4f}",
      f"{r['val_loss'] / ref['val_loss'] - 1:+.1%}" if ref else "",
      f"{r['train_loss']:.4f}",
      f"{r['zero_frac']:.1%}",
      str(r["skipped"]),
      na(r.get("recomputed"), "{}"),
      na(r.get("extra_passes"), "{:.1%}"),
      fmt_scale(r["loss_scale"]),
      f"{r['wall_s']:.1f}",
    )
    for name, r in results.items()
  ]
  widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
  lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
  return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def _kind(counts: dict) -> str:
  """``"inf"``, ``"nan"``, or ``"inf on 2, nan on 1"`` for a leaf that held both on some steps."""
  if counts["inf"] and counts["nan"]:
    return f"inf on {counts['inf']}, nan on {counts['nan']}"
  return "nan" if counts["nan"] else "inf"


def skips_by_parameter(results: dict, shown: int = 5) -> str:
  """The parameters whose gradients were not finite on the skipped steps, per run, most first.

  Reads each row's ``skips_by_parameter`` (``{leaf name: {"inf": steps, "nan": steps}}``)
  and ``skipped``; runs without skips are left out, and so is the whole text ("") when no run
  skipped a step.
  """
  lines = []
  for name, r in results.items():
    counts = r.get("skips_by_parameter") or {}
    if not counts:
      continue
    lines.append(f"  {name}, {r['skipped']} skipped steps:")
    width = max(len(leaf) for leaf in list(counts)[:shown])
    for leaf, c in list(counts.items())[:shown]:
      lines.append(f"    {leaf:<{width}}  {c['inf'] + c['nan']} of {r['skipped']} ({_kind(c)})")
    if len(counts) > shown:
      lines.append(f"    ... and {len(counts) - shown} more")
  if not lines:
    return ""
  return "\n".join(
    ["Skips by parameter (gradient leaves not finite on the skipped steps):"] + lines
  )


def located(results: dict, shown: int = 3) -> str:
  """Each run's ``located`` row (``optax_dls.locate`` on its first skipped step, as
  ``to_dict``): the operation that overflowed and the ``shown`` scopes closest to the limit;
  "" when no run has one."""
  lines = []
  for name, r in results.items():
    rep = r.get("located")
    if not rep:
      continue
    f = rep["first"]
    what = (
      "every value finite"
      if f is None
      else (
        f"{f['kind']} in the {f['phase']} pass: {f['primitive']} ({f['dtype']}) in "
        f"{f['scope'] or '(top level)'} at {f['source']}"
      )
    )
    lines.append(f"  {name}, first skipped step at loss scale {rep['scale']:g}: {what}")
    for h in rep["headroom"][:shown]:
      fwd = "overflow" if h["forward_overflow"] else f"{h['forward_fraction']:.1%}"
      bwd = "overflow" if h["backward_overflow"] else f"{h['backward_fraction']:.1%}"
      lines.append(f"    {h['scope']:<28} forward {fwd:>8}  backward {bwd:>8}")
  if not lines:
    return ""
  return "\n".join(["Located with optax_dls.locate (closest to float16's limit first):"] + lines)


COLORS = {
  "fp32": "0.55",
  "fp16": "tab:red",
  "fp16-dls": "tab:blue",
  "fp16-dls-recompute": "tab:green",
}
LABELS = {
  "fp32": "fp32",
  "fp16": "fp16, no loss scaling",
  "fp16-dls": "fp16 + dynamic loss scaling",
  "fp16-dls-recompute": "fp16 + dynamic loss scaling, overflows recomputed",
}
WIDTHS = {"fp32": 6.0}  # drawn wide, so that a run on top of it stays visible
DASHED = ("fp16-dls-recompute",)  # drawn dashed, so that fp16-dls under it stays visible
SCALED = ("fp16-dls", "fp16-dls-recompute")


def _style(name: str) -> dict:
  return {
    "color": COLORS.get(name),
    "lw": WIDTHS.get(name, 1.6),
    "alpha": 0.6 if name in WIDTHS else 1.0,
    "zorder": 1 if name in WIDTHS else 2,
    "ls": "--" if name in DASHED else "-",
  }


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
  """Running mean over ``k`` points ("valid" part: ``len(y) - k + 1`` points)."""
  k = max(1, min(k, len(y)))
  return np.convolve(y, np.ones(k) / k, mode="valid")


def _val_panel(ax, histories: dict, reference: str) -> None:
  """Validation-loss curves, the y range from the first sixth of the run on; final values in
  the legend."""
  ref = histories.get(reference)
  tops, lows = [], []
  for name, h in histories.items():
    step, val = np.asarray(h["eval_step"]), np.asarray(h["val_loss"], float)
    gap = (
      f" ({val[-1] / ref['val_loss'][-1] - 1:+.1%} vs {reference})"
      if ref is not None and name != reference
      else ""
    )
    ax.plot(
      step,
      val,
      marker="o" if name not in WIDTHS else None,
      ms=3,
      label=f"{LABELS.get(name, name)}: {val[-1]:.3f}{gap}",
      **_style(name),
    )
    late = val[step >= step[-1] / 6] if step.size > 1 else val
    tops.append(np.nanmax(late))
    lows.append(np.nanmin(val))
  top, low = max(tops), min(lows)
  ax.set_ylim(low - 0.05 * (top - low + 1e-9), top + 0.1 * (top - low + 1e-9))
  ax.set_ylabel("validation loss\n(nats per byte)")
  ax.set_title("validation loss (legend: after the last step)", fontsize=9)
  ax.legend(fontsize=9, loc="center right")


def _zero_panel(ax, histories: dict, k: int, reference: str) -> None:
  """Share of zero parameter-gradient entries per run, as a running mean."""
  for name, h in histories.items():
    z = 100 * _smooth(np.asarray(h["zero_frac"], float), k)
    label = LABELS.get(name, name) + (
      ": the floor, embedding rows of bytes absent from the batch" if name == reference else ""
    )
    ax.plot(np.asarray(h["step"])[k - 1 :], z, label=label, **_style(name))
  ax.set_ylim(bottom=0)
  ax.set_ylabel("gradient entries\nthat are 0 (%)")
  ax.set_title(
    f"parameter-gradient entries lost to float16 underflow (running mean over {k} steps)",
    fontsize=9,
  )
  ax.legend(fontsize=8, loc="upper left")


def _scale_panel(ax, histories: dict, scaled_runs: tuple[str, ...]) -> None:
  """The loss scale of each of ``scaled_runs`` after each step, its skipped and recomputed
  steps marked."""
  ax.set_title("loss scale S after each step (fp32 and fp16 are not scaled: S = 1)", fontsize=9)
  runs = [name for name in scaled_runs if name in histories]
  if not runs:
    ax.text(0.5, 0.5, f"no {' or '.join(scaled_runs)} run", ha="center", transform=ax.transAxes)
    return
  for name in runs:
    h = histories[name]
    step, scale, skipped = (np.asarray(h[key]) for key in ("step", "loss_scale", "skipped"))
    skipped = skipped.astype(bool)
    recomputed = np.diff(np.asarray(h["recomputed_steps"]), prepend=0) > 0
    style = {k: v for k, v in _style(name).items() if k in ("color", "ls")}
    ax.step(step, scale, where="post", label=f"{name}", **style)
    if skipped.any() or name not in DASHED:
      ax.plot(
        step[skipped],
        scale[skipped],
        "x",
        color="tab:orange",
        ms=7,
        mew=2,
        label=f"{name}: skipped (overflow, batch lost, S halved): {int(skipped.sum())}",
      )
    if recomputed.any() or name in DASHED:
      ax.plot(
        step[recomputed],
        scale[recomputed],
        "o",
        mfc="none",
        color="tab:purple",
        ms=7,
        mew=1.5,
        label=f"{name}: recomputed (overflow, S halved, batch kept): {int(recomputed.sum())}",
      )
  ax.set_yscale("log", base=2)
  ax.set_ylabel("loss scale S")
  ax.legend(fontsize=8, loc="lower right")


def plot(
  histories: dict,
  path: str,
  tokens: int | None = None,
  scaled_runs: tuple[str, ...] = SCALED,
  reference: str = "fp32",
) -> None:
  """Validation loss of every run, its zero-gradient share, and the loss-scale traces (PNG).

  Args:
    histories: ``{run: {"step", "loss", "loss_scale", "skipped",
      "recomputed_steps", "zero_frac", "eval_step", "val_loss"}}`` of 1-D
      arrays (``recomputed_steps`` cumulative); every run has the same data
      order, so the curves compare like with like.
    path: where to write the PNG.
    tokens: tokens per optimizer step, for the title.
    scaled_runs: the runs whose loss scale the bottom panel shows.
    reference: the run the others are compared with.
  """
  fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 10.5), sharex=True, height_ratios=(3, 2, 2))
  k = max(1, len(next(iter(histories.values()))["step"]) // 60)
  _val_panel(ax1, histories, reference)
  _zero_panel(ax2, histories, k, reference)
  _scale_panel(ax3, histories, scaled_runs)
  ax3.set_xlabel("optimizer step")
  for ax in (ax1, ax2, ax3):
    ax.grid(alpha=0.3)
  per_step = f", loss averaged over {tokens:,} tokens per step" if tokens else ""
  recompute = (
    " (overflowing steps skipped or recomputed)" if any(r in DASHED for r in histories) else ""
  )
  fig.suptitle(
    f"fp32 vs fp16 vs fp16 with dynamic loss scaling{recompute}\n"
    f"byte-level transformer LM{per_step}",
    fontsize=12,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
