"""The skip's two lowerings on an accelerator: step time against bare Adam, and host reads.

For the largest tree that fits (default about 1B float32 parameters in 256 leaves of
mixed sizes), times one optimizer step of bare ``optax.adam``, the floor (the bare
step on unscaled gradients plus one extra read of them) and ``dynamic_loss_scale``
under each skip lowering (``tx.update`` + ``optax.apply_updates``), on finite and
non-finite gradients. Each variant is
timed two ways: step by step (blocking after each step), and as a pipeline of steps
dispatched back to back (blocking once at the end), where a step that reads a value
back to the host stalls the dispatch of the next. Then it looks for device-to-host
traffic in each compiled step: conditionals in the optimised HLO (whose predicate a
GPU runtime reads back to the host unless it captures them in a graph), host
callbacks and transfers, and, in a profiler trace of a few steps, device-to-host
memory copies, and each variant's kernels in that trace: their device time per step,
the busiest kernels. With ``--train``, the main example's whole train step at GPT-2
small's size (fp16 compute, clipping and AdamW, a ``[8, 1024]`` token batch, or
``--train-batch``) under ``no_loss_scale`` and ``dynamic_loss_scale``. Prints one JSON
object and writes it to ``--json``. Usage::

    python benchmarks/gpu_check.py [--params 1000000000] [--leaves 256] [--steps 20]
    python benchmarks/gpu_check.py --variants device --train --json benchmarks/gpu_check_<gpu>.json

Runs on the CPU too (with ``--params 2000000``, say), where it checks itself.
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls

HOST_OPS = re.compile(r"\b(conditional|custom-call|send|recv|infeed|outfeed)\b")
D2H = re.compile(rb"[Mm]emcpy ?D(evice)?[ _-]?[Tt]o[ _-]?H(ost)?|DtoH|D2H")


def make_tree(total: int, leaves: int) -> dict:
  rng = np.random.default_rng(0)
  raw = rng.lognormal(0.0, 1.5, leaves)
  sizes = np.maximum(1, (raw / raw.sum() * total).astype(np.int64)).tolist()
  keys = jax.random.split(jax.random.key(0), leaves)
  return {
    f"p{i:03d}": jax.random.normal(k, (n,), jnp.float32)
    for i, (k, n) in enumerate(zip(keys, sizes))
  }


def bare(unscaled=False, extra_read=False):
  tx = optax.adam(1e-3)

  def init(params):
    return tx.init(params), jnp.float32(1.0), jnp.float32(0.0)

  def step(params, state, grads):
    opt_state, scale, read = state
    if extra_read:
      read = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    if unscaled:
      grads = jax.tree.map(lambda g: g * (1.0 / scale), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, scale, read)

  return init, step


def plain():
  """The plain skip: one float32 sum of squares per leaf gives the finite flag (and the
  norm), Adam runs on the unscaled gradients, ``jnp.where`` keeps the old parameters and
  state where the flag is down."""
  tx = optax.adam(1e-3)

  def init(params):
    return tx.init(params), jnp.float32(1.0), jnp.float32(0.0)

  def step(params, state, grads):
    opt_state, scale, _ = state
    total = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    ok = jnp.isfinite(total)
    unscaled = jax.tree.map(lambda g: jnp.where(ok, g * (1.0 / scale), 0.0), grads)
    updates, new_state = tx.update(unscaled, opt_state, params)
    keep = lambda new, old: jnp.where(ok, new, old)
    new_params = jax.tree.map(keep, optax.apply_updates(params, updates), params)
    new_state = jax.tree.map(keep, new_state, opt_state)
    return new_params, (new_state, jnp.where(ok, scale, scale / 2), jnp.sqrt(total) / scale)

  return init, step


def ours(lowering):
  if lowering == "no_loss_scale":
    tx = optax_dls.no_loss_scale(optax.adam(1e-3))
  else:
    tx = optax_dls.dynamic_loss_scale(
      optax.adam(1e-3), init_scale=1.0, min_scale=1.0, skip_lowering=lowering
    )

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


VARIANTS = {
  "bare_adam": (bare, False),
  "floor": (functools.partial(bare, unscaled=True, extra_read=True), False),
  "plain": (plain, False),
  **{
    f"{lowering}_update_{kind}": (functools.partial(ours, lowering), kind == "nonfinite")
    for lowering in ("auto", "cond", "where")
    for kind in ("finite", "nonfinite")
  },
  "no_loss_scale_update": (functools.partial(ours, "no_loss_scale"), False),
}


# The variants of one short run on a lent GPU: the references, the default (finite and
# skipped), and the conditional.
DEVICE = ["bare_adam", "floor", "plain", "auto_update_finite",
          "auto_update_nonfinite", "cond_update_finite", "no_loss_scale_update"]  # fmt: skip
GROUPS = {"device": DEVICE}


def kernel_profile(path: str, steps: int, top: int = 12) -> dict:
  """Device kernels of a trace (a ``perfetto_trace.json.gz`` under ``path``): their device
  time per step and the ``top`` busiest by name. Without a device in the trace (the CPU),
  the host's XLA operations instead."""
  found = glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)
  if not found:
    return {"error": "no perfetto trace written"}
  with open(found[0], "rb") as f:
    trace = json.loads(gzip.decompress(f.read()))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {
    e.get("pid"): e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  devices = {pid for pid, name in names.items() if name.startswith("/device:")}
  kernels: dict = {}
  for e in events:
    on_device = e.get("pid") in devices if devices else "fusion" in e.get("name", "")
    if e.get("ph") == "X" and on_device:
      k = kernels.setdefault(e["name"], [0, 0.0])
      k[0] += 1
      k[1] += e.get("dur", 0.0)
  busiest = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
  return {
    "source": "device" if devices else "host (no device in the trace)",
    "kernels_per_step": sum(n for n, _ in kernels.values()) / steps,
    "kernel_us_per_step": sum(t for _, t in kernels.values()) / steps,
    "busiest": {
      name: {"calls_per_step": n / steps, "us_per_step": t / steps} for name, (n, t) in busiest
    },
  }


def host_reads_in_profile(compiled, params, state, grads, steps=3):
  """Device-to-host copies seen in a profiler trace of ``steps`` steps, and the kernels of
  that trace (:func:`kernel_profile`)."""
  with tempfile.TemporaryDirectory() as d:
    try:
      with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(steps):
          params, state = compiled(params, state, grads)
        jax.block_until_ready(params)
    except Exception as e:  # noqa: BLE001 (a profiler that is not available here)
      return {"error": f"{type(e).__name__}: {e}"}, params, state
    count = 0
    for path in glob.glob(os.path.join(d, "**", "*"), recursive=True):
      if os.path.isfile(path):
        with open(path, "rb") as f:
          data = f.read()
        if path.endswith(".gz"):
          data = gzip.decompress(data)
        count += len(D2H.findall(data))
    kernels = kernel_profile(d, steps)
  return {"d2h_events_per_step": count / steps, "kernels": kernels}, params, state


def run_variant(name, params, grads, steps):
  factory, nonfinite = VARIANTS[name]
  init, step = factory()
  if nonfinite:
    first = min(grads)
    grads = dict(grads, **{first: grads[first].at[0].set(jnp.inf)})
  state = init(params)
  params = jax.tree.map(jnp.copy, params)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  out = {"compile_s": time.perf_counter() - t0}
  text = compiled.as_text()
  out["hlo_host_ops"] = sorted(set(HOST_OPS.findall(text)))
  for _ in range(3):
    params, state = compiled(params, state, grads)
  jax.block_until_ready(params)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    params, state = compiled(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t)
  out["median_step_s"] = statistics.median(times)
  t = time.perf_counter()
  for _ in range(steps):
    params, state = compiled(params, state, grads)
  jax.block_until_ready((params, state))
  out["pipelined_step_s"] = (time.perf_counter() - t) / steps
  profile, params, state = host_reads_in_profile(compiled, params, state, grads)
  out.update(profile)
  del params, state
  return out


def run_train(steps: int, batch: int = 8) -> dict:
  """The main example's train step at GPT-2 small's size under ``no_loss_scale`` and
  ``dynamic_loss_scale``, timed as :func:`run_variant` times a step, and their ratio."""
  import gpu_cases

  model, _ = gpu_cases.gpt2_small()
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(jax.random.key(1), (batch, 1025), 0, 256, jnp.int32)
  out = {}
  for name, wrap in (
    ("no_loss_scale", optax_dls.no_loss_scale),
    ("dynamic_loss_scale", optax_dls.dynamic_loss_scale),
  ):
    tx = wrap(gpu_cases.clip_adamw())
    step = gpu_cases.train_step(model, tx)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, tokens).compile()
    for _ in range(3):
      p, s, _ = compiled(p, s, tokens)
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      p, s, loss = compiled(p, s, tokens)
      jax.block_until_ready(loss)
      times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(steps):
      p, s, loss = compiled(p, s, tokens)
    jax.block_until_ready((p, s))
    out[name] = {
      "median_step_s": statistics.median(times),
      "pipelined_step_s": (time.perf_counter() - t) / steps,
    }
    del p, s
  for mode in ("median_step_s", "pipelined_step_s"):
    out[f"{mode}_ratio"] = out["dynamic_loss_scale"][mode] / out["no_loss_scale"][mode]
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=int, default=1_000_000_000, help="parameters in the tree")
  ap.add_argument("--leaves", type=int, default=256, help="leaves of mixed sizes")
  ap.add_argument("--steps", type=int, default=20, help="timed steps per variant and mode")
  ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list, or 'device'")
  ap.add_argument("--train", action="store_true", help="time the main example's train step too")
  ap.add_argument("--train-batch", type=int, default=8, help="sequences of 1,024 tokens")
  ap.add_argument("--json", help="also write the JSON object to this file")
  args = ap.parse_args(argv)
  names = GROUPS.get(args.variants) or args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)} (or 'device')")
  params = make_tree(args.params, args.leaves)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  out = {
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0]),
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "leaves": len(params),
    "steps": args.steps,
    "results": {},
  }
  for name in names:
    out["results"][name] = run_variant(name, params, grads, args.steps)
    print(f"{name}: {out['results'][name]}", file=sys.stderr, flush=True)
  for ref in ("bare_adam", "floor"):
    if ref in out["results"]:
      for mode in ("median_step_s", "pipelined_step_s"):
        base = out["results"][ref][mode]
        for r in out["results"].values():
          r[f"{mode}_ratio_to_{ref}"] = r[mode] / base
  finite = {k: v for k, v in out["results"].items() if k.endswith("_finite")}
  if finite:
    best = min(finite, key=lambda k: finite[k]["pipelined_step_s"])
    out["fastest_update_path"] = min(
      (k for k in finite if "_update_" in k), key=lambda k: finite[k]["pipelined_step_s"]
    )
    out["fastest_overall"] = best
  del params, grads
  if args.train:
    out["train_step"] = run_train(args.steps, args.train_batch)
  print(json.dumps(out, indent=2))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main()
