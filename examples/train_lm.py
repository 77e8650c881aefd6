"""Train a small byte-level transformer LM in fp32, fp16, and fp16 with dynamic loss scaling.

    python examples/train_lm.py                      # defaults: about 3 minutes on 2 CPU cores
    python examples/train_lm.py --runs fp32,fp16-dls --steps 200 --out runs/quick

Three runs share one initialisation and one data order; only the precision and
the loss scaling differ (Micikevicius et al. 2018, *Mixed Precision Training*):

  fp32      float32 everywhere, ``optax_dls.no_loss_scale``
  fp16      float16 matmuls/activations, float32 master weights, no loss scaling
  fp16-dls  as fp16, with ``optax_dls.dynamic_loss_scale``

At steps 0, steps/2 and steps a gradient-signal diagnostic compares, on one
fixed held-out batch and the fp32 run's parameters (the first run's when fp32
is not run), the gradients of the fp16 model without loss scaling and at the
fp16-dls run's loss scale then (2**15 when fp16-dls is not run) against fp32:
see ``lm/diagnostic.py``.

Everything lands in one folder (``--out``; printed at the end): ``metrics.jsonl``,
TensorBoard events under ``tb/<run>``, ``train_lm.png``, ``summary.json`` and
``diagnostic.json``.
"""

from __future__ import annotations

import argparse
import math
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import optax_dls
from lm import data, diagnostic, report
from lm.model import Transformer, loss_fn
from lm.precision import FP16, FP32

RUNS = {"fp32": FP32, "fp16": FP16, "fp16-dls": FP16}


def parse_args(argv=None) -> argparse.Namespace:
  """Parses the flags and loads the text; bad input exits with an argparse error (code 2).

  Adds ``train`` and ``val`` (uint8 byte arrays) to the namespace and turns
  ``runs`` into a list. Raises ``SystemExit(2)`` with a usage message for an
  unknown run, a non-positive size, ``--heads`` not dividing ``--d-model``,
  or a ``--text`` file that is missing, empty, not UTF-8 or too short.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--runs", default="fp32,fp16,fp16-dls", help="comma-separated subset of " + ",".join(RUNS))
  p.add_argument("--steps", type=int, default=600, help="updates per run (default 600)")
  p.add_argument("--batch-size", type=int, default=16, help="sequences per batch (default 16)")
  p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
  p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
  p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
  p.add_argument("--heads", type=int, default=4, help="attention heads, dividing --d-model (default 4)")
  p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
  p.add_argument("--growth-interval", type=int, default=50,
                 help="clean steps before the loss scale grows, fp16-dls (default 50)")
  p.add_argument("--eval-every", type=int, default=100, help="updates between validation passes")
  p.add_argument("--eval-batches", type=int, default=8, help="fixed held-out batches per validation pass")
  p.add_argument("--seed", type=int, default=0, help="initialisation and data order (default 0)")
  p.add_argument("--text", help="train on this UTF-8 text file instead of the Python reference manual")
  p.add_argument("--out", help="output folder (default runs/train_lm-<timestamp>)")
  args = p.parse_args(argv)
  args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  bad = [r for r in args.runs if r not in RUNS]
  if bad or not args.runs or len(set(args.runs)) != len(args.runs):
    p.error(f"argument --runs: expected distinct names from {','.join(RUNS)}, got {','.join(args.runs) or '(none)'}")
  for name in ("steps", "batch_size", "seq_len", "d_model", "layers", "heads", "growth_interval",
               "eval_every", "eval_batches"):
    if getattr(args, name) < 1:
      p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
  if args.d_model % args.heads:
    p.error(f"argument --heads: must divide --d-model {args.d_model}, got {args.heads}")
  if not 0 < args.lr < math.inf:
    p.error(f"argument --lr: must be finite and > 0, got {args.lr}")
  if not 0 <= args.seed <= 2**32 - 1:
    p.error(f"argument --seed: must be in [0, 2**32 - 1], got {args.seed}")
  if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
    p.error(f"argument --out: must be a folder, got the existing file {args.out!r}")
  try:
    text = data.read_text(args.text) if args.text else data.default_text()
    args.train, args.val = data.split_bytes(text, args.seq_len + 1)
  except data.DataError as e:
    p.error(str(e))
  args.out = args.out or os.path.join("runs", time.strftime("train_lm-%Y%m%d-%H%M%S"))
  return args


def make_optimizer(name, args):
  """AdamW with warmup + cosine decay and global-norm clipping, wrapped by optax_dls."""
  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.01))
  if name == "fp16-dls":
    return optax_dls.dynamic_loss_scale(inner, growth_interval=args.growth_interval)
  return optax_dls.no_loss_scale(inner)


def train_run(name, args, params, log, snapshot_steps):
  """One run. Returns (summary row, history, {step: (params, loss scale)} at snapshot_steps)."""
  window = args.seq_len + 1
  model = Transformer(args.d_model, args.layers, args.heads, args.seq_len, RUNS[name])
  tx = make_optimizer(name, args)

  @jax.jit
  def train_step(params, opt_state, batch):
    def scaled_loss(p):
      loss = loss_fn(model, p, batch)
      return optax_dls.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, **optax_dls.metrics(opt_state)}

  evaluate = jax.jit(lambda p, b: loss_fn(model, p, b))
  val_batch = data.gather(args.val, data.eval_starts(args.val.size, window, args.eval_batches, args.batch_size),
                          window).reshape(-1, window)
  order = data.batch_starts(args.train.size, window, args.steps, args.batch_size, args.seed)
  opt_state = jax.jit(tx.init)(params)
  hist = {k: [] for k in ("step", "loss", "loss_scale", "skipped", "eval_step", "val_loss")}
  snaps, t0 = {}, time.perf_counter()

  def validate(step):
    v = float(evaluate(params, val_batch))
    hist["eval_step"].append(step)
    hist["val_loss"].append(v)
    log.write(name, "eval", step, val_loss=v, wall_s=time.perf_counter() - t0)

  def snapshot(step):
    if step in snapshot_steps:
      snaps[step] = (jax.device_get(params), float(optax_dls.loss_scale(opt_state)))

  validate(0)
  snapshot(0)
  bar = tqdm(range(1, args.steps + 1), desc=f"{name:>8}", unit="step", mininterval=1.0)
  for step in bar:
    params, opt_state, m = train_step(params, opt_state, data.gather(args.train, order[step - 1], window))
    m = jax.device_get(m)
    for k in ("loss", "loss_scale", "skipped"):
      hist[k].append(m[k])
    hist["step"].append(step)
    log.write(name, "train", step, loss=m["loss"], loss_scale=m["loss_scale"], skipped=m["skipped"],
              skip_count=m["skip_count"], update_ratio=m["update_ratio"], grad_norm=m["grad_norm"],
              wall_s=time.perf_counter() - t0)
    if step % 10 == 0:
      bar.set_postfix(loss=f"{m['loss']:.3f}", scale=f"{m['loss_scale']:g}", skipped=int(m["skip_count"]))
    if step % args.eval_every == 0 or step == args.steps:
      validate(step)
    snapshot(step)
  bar.close()
  row = {"train_loss": float(np.mean(hist["loss"][-20:])), "val_loss": hist["val_loss"][-1],
         "skipped": int(m["skip_count"]), "update_ratio": float(m["update_ratio"]),
         "loss_scale": float(m["loss_scale"]), "wall_s": time.perf_counter() - t0}
  return row, {k: np.asarray(v) for k, v in hist.items()}, snaps


def main(argv=None) -> int:
  """Runs the example with command-line flags ``argv`` (default ``sys.argv[1:]``); returns 0."""
  start = time.perf_counter()
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  source = args.text or "pydoc_data.topics (the Python reference manual)"
  print(f"data: {source}: {args.train.size} train / {args.val.size} validation bytes")
  model = Transformer(args.d_model, args.layers, args.heads, args.seq_len, FP32)
  params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
  print(f"model: {sum(x.size for x in jax.tree.leaves(params)):,} parameters; "
        f"{args.steps} steps of {args.batch_size}x{args.seq_len} bytes per run")

  diag_steps = sorted({0, args.steps // 2, args.steps})
  ref = "fp32" if "fp32" in args.runs else args.runs[0]
  log, results, histories, snaps = report.MetricsLog(args.out), {}, {}, {}
  for name in args.runs:
    results[name], histories[name], snaps[name] = train_run(name, args, params, log, diag_steps)
  log.close()

  grad_fns = {"fp32": diagnostic.make_grad_fn(model),
              "fp16": diagnostic.make_grad_fn(model.clone(precision=FP16))}
  window = args.seq_len + 1
  batch = data.gather(args.val, data.eval_starts(args.val.size, window, 1, args.batch_size)[0], window)
  points = []
  for step in diag_steps:
    scale = snaps["fp16-dls"][step][1] if "fp16-dls" in snaps else 2.0**15
    points.append({"step": step} | diagnostic.gradient_signal(grad_fns, snaps[ref][step][0], batch, scale))

  report.plot(histories, os.path.join(args.out, "train_lm.png"))
  with open(os.path.join(args.out, "diagnostic.json"), "w") as f:
    json.dump({"params_from": ref, "points": points}, f, indent=2)
  config = {k: v for k, v in vars(args).items() if k not in ("train", "val")}
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump({"config": config, "runs": results, "diagnostic": points}, f, indent=2)

  print("\n" + report.table(results))
  if "fp32" in results and "fp16-dls" in results:
    gap = results["fp16-dls"]["val_loss"] / results["fp32"]["val_loss"] - 1
    print(f"fp16-dls validation loss vs fp32: {gap:+.2%}")
  print(f"\ngradient signal against fp32, on one fixed held-out batch, with the {ref} run's parameters:\n"
        "  zeroed = nonzero fp32 parameter-gradient entries that are 0; rel.err = |g - g32| / |g32|;\n"
        "  dlogits flushed = nonzero loss-gradient (d loss / d logits) entries that the cast to fp16 makes 0")
  print(report.diagnostic_table(points))
  cpu = time.process_time()
  print(f"\ntotal wall time {time.perf_counter() - start:.0f} s (process CPU time {cpu:.0f} s)")
  print(f"outputs: {os.path.abspath(args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
