"""Train a small byte-level transformer LM in fp32, fp16, and fp16 with dynamic loss scaling.

    python examples/train_lm.py                        # defaults: about 3 minutes on 2 CPU cores
    python examples/train_lm.py --runs fp32 --replicas 1 --out runs/control

Four runs share one initialisation and one data order; only the precision and
the loss scaling differ (Micikevicius et al. 2018, *Mixed Precision Training*):

  fp32                float32 everywhere, ``optax_dls.no_loss_scale``
  fp16                float16 matmuls/activations, float32 master weights, no loss scaling
  fp16-dls            as fp16, with ``optax_dls.dynamic_loss_scale``: an overflowing step is
                      skipped (its batch is lost) and the scale halved
  fp16-dls-recompute  as fp16-dls, the gradients from ``optax_dls.value_and_grad``: an
                      overflowing step is recomputed at the halved scale inside the same
                      jitted step (up to ``--max-tries`` times), so no batch is lost

Both fp16-dls runs start at 2**15 and double the scale after every
``--growth-interval`` (10) clean steps, up to ``--max-scale`` (2**32): the scale
keeps probing upward and overflows every dozen steps or so once it has reached
the largest one the gradients allow, as dynamic scaling does over a long run.

The optimizer step is one of data-parallel training: its loss is the mean
over a global batch of ``--replicas`` x ``--micro-batches`` x ``--batch-size``
x ``--seq-len`` tokens (64 x 1 x 16 x 64 = 65,536 by default). Each
micro-batch's loss is the sum of its token losses divided by that global
count, as when a batch sharded over devices is averaged under ``jit``, or when
gradient accumulation divides by the step's token count (Hugging Face's
``num_items_in_batch``), so each micro-batch's backward pass carries
per-token gradients of about p / 65,536, below float16's smallest subnormal
(2**-24) for every byte of probability p < 0.004. This script computes one
replica: the sum of its micro-batch gradients times ``--replicas`` (in
float32) stands in for the sum over the replicas that the all-reduce makes.
The optimizer therefore gets the gradient of the mean loss over this
replica's tokens, as with ``--replicas 1``; only the float16 backward pass
sees the difference.

Everything lands in one folder (``--out``; printed at the end): ``metrics.jsonl``
(every run's rows, with a ``run`` column) and TensorBoard events under
``tb/<run>``, both written by ``optax_dls.writers.MetricsWriter`` and read by
``optax-dls inspect``; ``train_lm.png`` and ``summary.json``. The writers are
given the parameters, so each row of a new non-finite step names the gradient
leaves that held an inf or a NaN; the summary printed at the end counts, per
parameter, the skipped steps it was not finite in. On fp16-dls's first skipped step,
``optax_dls.locate`` replays its first micro-batch at the scale it ran at (a few
seconds, once): the summary prints the operation that overflowed and the three
scopes closest to float16's limit, and ``locate.json`` keeps the report, which
``optax-dls inspect`` shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from lm import data, report
from lm.model import Transformer, loss_fn, loss_sum
from lm.precision import FP16, FP32
from tqdm import tqdm

import optax_dls
from optax_dls.writers import JSONL_NAME, MetricsWriter

RUNS = {"fp32": FP32, "fp16": FP16, "fp16-dls": FP16, "fp16-dls-recompute": FP16}
RECOMPUTED = ("fp16-dls-recompute",)  # runs whose overflowing steps are recomputed
# The fp16-dls runs' scale: the scale probes upward every 10 clean steps, about 30 probes in 300
# steps, as many as a 2,000-step interval makes in 60,000 steps; the steps' gradients, p / 65,536
# per token, take scales above optax_dls's default cap of 2**24 before they overflow.
INIT_SCALE, GROWTH_INTERVAL, MAX_SCALE = 2.0**15, 10, 2.0**32
SIZES = (
  "steps",
  "replicas",
  "micro_batches",
  "batch_size",
  "seq_len",
  "d_model",
  "layers",
  "heads",
  "growth_interval",
  "eval_every",
  "eval_batches",
)


def parse_args(argv=None) -> argparse.Namespace:
  """Parses the flags and loads the text; bad input exits with an argparse error (code 2).

  Adds ``train`` and ``val`` (uint8 byte arrays) to the namespace and turns
  ``runs`` into a list. Raises ``SystemExit(2)`` with a usage message for an
  unknown run, a non-positive size, ``--heads`` not dividing ``--d-model``,
  or a ``--text`` file that is missing, empty, not UTF-8 or too short.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS)
  )
  p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
  p.add_argument(
    "--replicas",
    type=int,
    default=64,
    help="data-parallel replicas whose tokens the loss is averaged over; one is computed "
    "(default 64; 1: the loss is the mean over this replica's tokens)",
  )
  p.add_argument(
    "--micro-batches",
    type=int,
    default=1,
    help="micro-batches accumulated per replica and step (default 1)",
  )
  p.add_argument(
    "--batch-size", type=int, default=16, help="sequences per micro-batch (default 16)"
  )
  p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
  p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
  p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
  p.add_argument(
    "--heads", type=int, default=4, help="attention heads, dividing --d-model (default 4)"
  )
  p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
  p.add_argument(
    "--init-scale",
    type=float,
    default=INIT_SCALE,
    help=f"initial loss scale, fp16-dls runs (default 2**{math.log2(INIT_SCALE):g})",
  )
  p.add_argument(
    "--growth-interval",
    type=int,
    default=GROWTH_INTERVAL,
    help=f"clean steps before the loss scale doubles, fp16-dls runs (default {GROWTH_INTERVAL})",
  )
  p.add_argument(
    "--max-scale",
    type=float,
    default=MAX_SCALE,
    help=f"largest loss scale, fp16-dls runs (default 2**{math.log2(MAX_SCALE):g})",
  )
  p.add_argument(
    "--max-tries",
    type=int,
    default=3,
    help="float16 recomputations of an overflowing step, fp16-dls-recompute (default 3)",
  )
  p.add_argument(
    "--eval-every", type=int, default=25, help="steps between validation passes (default 25)"
  )
  p.add_argument(
    "--eval-batches",
    type=int,
    default=8,
    help="fixed held-out batches of --batch-size sequences per validation pass (default 8)",
  )
  p.add_argument("--seed", type=int, default=0, help="initialisation and data order (default 0)")
  p.add_argument(
    "--text", help="train on this UTF-8 text file instead of the Python reference manual"
  )
  p.add_argument("--out", help="output folder (default runs/train_lm-<timestamp>)")
  args = p.parse_args(argv)
  args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  bad = [r for r in args.runs if r not in RUNS]
  if bad or not args.runs or len(set(args.runs)) != len(args.runs):
    got = ",".join(args.runs) or "(none)"
    p.error(f"argument --runs: expected distinct names from {','.join(RUNS)}, got {got}")
  _check_numbers(p, args)
  if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
    p.error(f"argument --out: must be a folder, got the existing file {args.out!r}")
  try:
    text = data.read_text(args.text) if args.text else data.default_text()
    args.train, args.val = data.split_bytes(text, args.seq_len + 1)
  except data.DataError as e:
    p.error(str(e))
  args.out = args.out or os.path.join("runs", time.strftime("train_lm-%Y%m%d-%H%M%S"))
  return args


def _check_numbers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Exits with an argparse error (code 2) for a size < 1, ``--heads`` not dividing
  ``--d-model``, or a scale, try count, learning rate or seed out of its range."""
  for name in SIZES:
    if getattr(args, name) < 1:
      p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
  if args.d_model % args.heads:
    p.error(f"argument --heads: must divide --d-model {args.d_model}, got {args.heads}")
  if not 1.0 <= args.init_scale <= 2.0**126:
    p.error(f"argument --init-scale: must be in [1, 2**126], got {args.init_scale}")
  if not args.init_scale <= args.max_scale <= 2.0**126:
    p.error(f"argument --max-scale: must be in [--init-scale, 2**126], got {args.max_scale}")
  if not 0 <= args.max_tries <= 64:
    p.error(f"argument --max-tries: must be in [0, 64], got {args.max_tries}")
  if not 0 < args.lr < math.inf:
    p.error(f"argument --lr: must be finite and > 0, got {args.lr}")
  if not 0 <= args.seed <= 2**32 - 1:
    p.error(f"argument --seed: must be in [0, 2**32 - 1], got {args.seed}")


def tokens_per_step(args) -> int:
  """Tokens the loss of one optimizer step is averaged over, all replicas together."""
  return args.replicas * args.micro_batches * args.batch_size * args.seq_len


def make_optimizer(name, args):
  """AdamW with warmup + cosine decay and global-norm clipping, wrapped by optax_dls."""
  lr = optax.warmup_cosine_decay_schedule(
    0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10
  )
  # underflow_stats records the share of exactly-zero entries of the unscaled gradients
  # (underflow/zero_frac in optax_dls.metrics): in the fp16 runs a gradient too small for
  # float16 flushes to 0 in the backward pass, and the float32 parameter gradient it feeds
  # loses it; the fp32 run's share is the floor no precision changes (the embedding rows
  # of the bytes absent from the step's batch).
  # recompute_stats counts what optax_dls.value_and_grad recomputes (recomputed_steps and
  # recompute_tries in optax_dls.metrics); chained in every run, so that every run's rows have
  # the same keys (0 where nothing is recomputed).
  inner = optax.chain(
    optax_dls.underflow_stats(),
    optax_dls.recompute_stats(),
    optax.clip_by_global_norm(1.0),
    optax.adamw(lr, weight_decay=0.01),
  )
  if name.startswith("fp16-dls"):
    return optax_dls.dynamic_loss_scale(
      inner,
      init_scale=args.init_scale,
      growth_interval=args.growth_interval,
      max_scale=args.max_scale,
    )
  return optax_dls.no_loss_scale(inner)


def make_train_step(model, tx, args, max_tries=None):
  """Jitted ``(params, opt_state, batches) -> (params, opt_state, metrics)`` for one optimizer step.

  ``batches`` is int32 ``[micro_batches, batch_size, seq_len + 1]``. Each
  micro-batch's loss is its summed token loss over :func:`tokens_per_step`,
  times the loss scale; the micro-batch gradients are summed in float32, and
  the sum is multiplied by ``args.replicas`` in place of the sum over
  replicas. ``metrics["loss"]`` is the mean token loss of the step's batch.

  With ``max_tries`` (an int), each micro-batch's gradients come from
  ``optax_dls.value_and_grad``: a micro-batch whose gradients overflow is
  recomputed at the backed-off scale inside the step, and the sum of the
  micro-batches before it is brought to the new scale (a power-of-two ratio:
  exact), so the step is applied instead of skipped.
  """
  n = tokens_per_step(args)

  def micro_batch_loss(p, batch):
    return loss_sum(model, p, batch) / n

  def micro_batch_grads(opt_state, params, batch):
    def scaled_loss(p):
      loss = micro_batch_loss(p, batch)
      return optax_dls.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    return (loss, grads), opt_state

  if max_tries is not None:
    micro_batch_grads = optax_dls.value_and_grad(micro_batch_loss, tx, max_tries=max_tries)

  @jax.jit
  def train_step(params, opt_state, batches):
    def accumulate(carry, batch):
      total, opt_state = carry
      before = optax_dls.find_state(opt_state).loss_scale
      (loss, grads), opt_state = micro_batch_grads(opt_state, params, batch)
      if max_tries is not None:  # this micro-batch backed the scale off: the earlier ones follow
        ratio = optax_dls.find_state(opt_state).loss_scale / before
        total = jax.tree.map(lambda t: t * ratio, total)
      return (jax.tree.map(jnp.add, total, grads), opt_state), loss

    (grads, opt_state), losses = jax.lax.scan(
      accumulate, (jax.tree.map(jnp.zeros_like, params), opt_state), batches
    )
    grads = jax.tree.map(lambda g: g * args.replicas, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    m = {"loss": losses.sum() * args.replicas, **optax_dls.metrics(opt_state)}
    return optax.apply_updates(params, updates), opt_state, m

  return train_step


def run_writers(out: str, name: str, params) -> tuple[MetricsWriter, MetricsWriter]:
  """A run's writers: rows appended to ``<out>/metrics.jsonl``, TensorBoard events in
  ``<out>/tb/<name>``; ``params`` names the leaves of a non-finite step in the rows."""
  return (
    MetricsWriter(out, run_name=name, tensorboard=False, params=params),
    MetricsWriter(os.path.join(out, "tb", name), jsonl=False, params=params),
  )


class SkipsByParameter:
  """Per gradient leaf, the skipped steps it was not finite in, with an inf or a NaN."""

  def __init__(self, params):
    self.shapes = jax.eval_shape(lambda: params)  # the tree and dtypes that name the leaves
    self.counts: dict[str, dict[str, int]] = {}

  def update(self, m: dict) -> None:
    """Counts the step of the metrics ``m`` (host values) if it was skipped: its non-finite
    record is then that step's (a recomputed overflow is not counted: its step was applied)."""
    if not m["skipped"]:
      return
    for name, kind in optax_dls.nonfinite_leaves(m, self.shapes).items():
      self.counts.setdefault(name, {"inf": 0, "nan": 0})[kind] += 1

  def result(self) -> dict[str, dict[str, int]]:
    """``{leaf name: {"inf": steps, "nan": steps}}``, most steps first."""
    return dict(sorted(self.counts.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])))


class Progress:
  """A tqdm bar when stderr is a terminal; otherwise a plain line every quarter of the run."""

  def __init__(self, name: str, steps: int, recomputes: bool = False):
    self.name, self.steps, self.recomputes = name, steps, recomputes
    self.width = max(map(len, RUNS))  # the names aligned
    self.bar = (
      tqdm(total=steps, desc=f"{name:>{self.width}}", unit="step", mininterval=1.0)
      if sys.stderr.isatty()
      else None
    )

  def update(self, step: int, m: dict) -> None:
    counts = {"skipped": int(m["skip_count"])}
    if self.recomputes:
      counts["recomputed"] = int(m["recomputed_steps"])
    if self.bar is not None:
      self.bar.update(1)
      if step % 10 == 0:
        self.bar.set_postfix(
          loss=f"{m['loss']:.3f}", scale=report.fmt_scale(m["loss_scale"]), **counts
        )
    elif step % max(1, self.steps // 4) == 0 or step == self.steps:
      print(
        f"{self.name:>{self.width}}: step {step}/{self.steps}  loss {m['loss']:.3f}  "
        f"zero grads {m['underflow/zero_frac']:.1%}  "
        f"loss scale {report.fmt_scale(m['loss_scale'])}  "
        + "  ".join(f"{k} {v}" for k, v in counts.items()),
        flush=True,
      )

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def locate_skip(model, args, params, batches, scale):
  """``optax_dls.locate`` on the first micro-batch of a skipped step, at the scale it ran at:
  the operation that overflowed and the scopes closest to float16's limit."""
  n = tokens_per_step(args)
  return optax_dls.locate(lambda p, b: loss_sum(model, p, b) / n, params, batches[0], scale=scale)


def train_run(name, args, params):
  """One run, logged by :func:`run_writers`. Returns (summary row, history of 1-D arrays)."""
  window = args.seq_len + 1
  model = Transformer(args.d_model, args.layers, args.heads, args.seq_len, RUNS[name])
  tx = make_optimizer(name, args)
  train_step = make_train_step(model, tx, args, args.max_tries if name in RECOMPUTED else None)
  evaluate = jax.jit(lambda p, b: loss_fn(model, p, b))
  val_batch = data.gather(
    args.val, data.eval_starts(args.val.size, window, args.eval_batches, args.batch_size), window
  ).reshape(-1, window)
  order = data.batch_starts(
    args.train.size, window, args.steps * args.micro_batches, args.batch_size, args.seed
  )
  order = order.reshape(args.steps, args.micro_batches, args.batch_size)
  opt_state = jax.jit(tx.init)(params)
  hist = {
    k: []
    for k in (
      "step",
      "loss",
      "loss_scale",
      "skipped",
      "recomputed_steps",
      "zero_frac",
      "eval_step",
      "val_loss",
    )
  }
  t0 = time.perf_counter()
  writers = run_writers(args.out, name, params)
  skips_by_parameter = SkipsByParameter(params)
  located = None  # fp16-dls: locate's report on the batch of the first skipped step
  scale = float(optax_dls.find_state(opt_state).loss_scale)  # the scale the next step runs at

  def log(step, values):
    for w in writers:
      w.log(step, values, wall_s=time.perf_counter() - t0)

  def validate(step):
    v = float(evaluate(params, val_batch))
    hist["eval_step"].append(step)
    hist["val_loss"].append(v)
    log(step, {"val_loss": v})

  validate(0)
  progress = Progress(name, args.steps, recomputes=name in RECOMPUTED)
  for step in range(1, args.steps + 1):
    batches = data.gather(args.train, order[step - 1], window)
    before = params
    params, opt_state, m = train_step(params, opt_state, batches)
    m = jax.device_get(m)
    if name == "fp16-dls" and m["skipped"] and located is None:
      located = locate_skip(model, args, before, batches, scale)
      writers[0].write_locate(located, step=step)
    scale = float(m["loss_scale"])
    log(step, m)
    skips_by_parameter.update(m)
    for k in ("loss", "loss_scale", "skipped", "recomputed_steps"):
      hist[k].append(m[k])
    hist["zero_frac"].append(m["underflow/zero_frac"])
    hist["step"].append(step)
    progress.update(step, m)
    if step % args.eval_every == 0 or step == args.steps:
      validate(step)
  progress.close()
  for w in writers:
    w.close()
  hist = {k: np.asarray(v) for k, v in hist.items()}
  recomputes = name in RECOMPUTED  # the other runs have no recomputation to report (None)
  row = {
    "train_loss": float(np.mean(hist["loss"][-20:])),
    "val_loss": float(hist["val_loss"][-1]),
    "zero_frac": float(np.median(hist["zero_frac"][len(hist["zero_frac"]) // 2 :])),
    "skipped": int(m["skip_count"]),
    "recomputed": int(m["recomputed_steps"]) if recomputes else None,
    # Extra forward and backward passes over the run's steps x micro-batches passes.
    "extra_passes": int(m["recompute_tries"]) / (args.steps * args.micro_batches)
    if recomputes
    else None,
    "loss_scale": float(m["loss_scale"]),
    "skips_by_parameter": skips_by_parameter.result(),
    "located": None if located is None else located.to_dict(),
    "wall_s": time.perf_counter() - t0,
  }
  return row, hist


def main(argv=None) -> int:
  """Runs the example with command-line flags ``argv`` (default ``sys.argv[1:]``); returns 0."""
  start = time.perf_counter()
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  open(os.path.join(args.out, JSONL_NAME), "w").close()  # the runs below append to it
  source = args.text or "pydoc_data.topics (the Python reference manual)"
  print(f"data: {source}: {args.train.size} train / {args.val.size} validation bytes")
  model = Transformer(args.d_model, args.layers, args.heads, args.seq_len, FP32)
  params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))[
    "params"
  ]
  n = tokens_per_step(args)
  print(
    f"model: {sum(x.size for x in jax.tree.leaves(params)):,} parameters; "
    f"{args.steps} steps per run; "
    f"loss averaged over {n:,} tokens per step ({args.replicas} replicas x {args.micro_batches} "
    f"micro-batches x {args.batch_size} x {args.seq_len} bytes), one replica computed",
    flush=True,
  )

  results, histories = {}, {}
  for name in args.runs:
    results[name], histories[name] = train_run(name, args, params)

  report.plot(histories, os.path.join(args.out, "train_lm.png"), tokens=n)
  config = {k: v for k, v in vars(args).items() if k not in ("train", "val")}
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump({"config": config, "tokens_per_step": n, "runs": results}, f, indent=2)

  print("\n" + report.table(results))
  if skips := report.skips_by_parameter(results):
    print("\n" + skips)
  if located := report.located(results):
    print("\n" + located)
  cpu = time.process_time()
  print(f"\ntotal wall time {time.perf_counter() - start:.0f} s (process CPU time {cpu:.0f} s)")
  print(f"outputs: {os.path.abspath(args.out)}  (optax-dls inspect {args.out})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
