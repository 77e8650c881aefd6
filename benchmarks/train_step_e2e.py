"""The main example's fp16 train step with dynamic loss scaling vs the no-op wrapper.

Same model (examples/lm, fp16 compute), same batch, same AdamW + clipping; only the
wrapper differs. ``dynamic_loss_scale+value_and_grad`` takes the gradients from
``optax_dls.value_and_grad`` (an overflowing step recomputed inside the step, the
passes counted by ``optax_dls.recompute_stats`` chained inside) in its common case, no
overflow, against ``dynamic_loss_scale`` (``jax.grad`` of
``scale_loss(loss)``): ``ratio_to_dynamic_loss_scale``, with
``paired_ratio_to_dynamic_loss_scale`` the median over rounds of the same ratio
taken round by round. ``dynamic_loss_scale+again``, the same step compiled a
second time, measures what the machine's noise alone gives that ratio. Variants
are timed in interleaved rounds so that drift in machine load hits them alike.
Prints one JSON object. Usage::

    python benchmarks/train_step_e2e.py [--rounds 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from lm.model import Transformer, loss_fn
from lm.precision import FP16


def inner():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))


VARIANTS = {
  "no_loss_scale": lambda: optax_dls.no_loss_scale(inner()),
  "dynamic_loss_scale": lambda: optax_dls.dynamic_loss_scale(inner(), growth_interval=50),
  "dynamic_loss_scale_where": lambda: optax_dls.dynamic_loss_scale(
    inner(), growth_interval=50, skip_lowering="where"
  ),
}
RECOMPUTE = "dynamic_loss_scale"  # also timed with optax_dls.value_and_grad


def counted():
  """``dynamic_loss_scale`` as timed with ``value_and_grad``: ``recompute_stats`` chained
  inside (an identity transformation) counts the recomputed passes, read after the timing."""
  return optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.recompute_stats(), inner()), growth_interval=50
  )


def make_step(model, tx, recompute=False):
  grad_fn = optax_dls.value_and_grad(lambda p, batch: loss_fn(model, p, batch), tx, max_tries=3)

  def step(params, opt_state, batch):
    def scaled_loss(p):
      loss = loss_fn(model, p, batch)
      return optax_dls.scale_loss(loss, opt_state), loss

    if recompute:
      (loss, grads), opt_state = grad_fn(opt_state, params, batch)
    else:
      grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per variant")
  ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
  ap.add_argument("--batch-size", type=int, default=16)
  ap.add_argument("--seq-len", type=int, default=64)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--heads", type=int, default=4)
  args = ap.parse_args(argv)

  model = Transformer(args.d_model, args.layers, args.heads, args.seq_len, FP16)
  params0 = model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
  batch = jnp.asarray(
    np.random.default_rng(0).integers(0, 256, (args.batch_size, args.seq_len + 1)), jnp.int32
  )
  runs = {}
  variants = [(name, make, False) for name, make in VARIANTS.items()]
  variants += [
    (RECOMPUTE + "+value_and_grad", counted, True),
    (RECOMPUTE + "+again", VARIANTS[RECOMPUTE], False),
  ]
  for name, make, recompute in variants:
    tx = make()
    step = make_step(model, tx, recompute)
    params = jax.tree.map(jnp.copy, params0)
    state = tx.init(params)
    for _ in range(3):  # compile and warm up
      params, state, loss = step(params, state, batch)
    jax.block_until_ready(loss)
    runs[name] = {"step": step, "carry": (params, state), "times": [], "rounds": []}
  for _ in range(args.rounds):
    for run in runs.values():
      params, state = run["carry"]
      times = []
      for _ in range(args.steps):
        t = time.perf_counter()
        params, state, loss = run["step"](params, state, batch)
        jax.block_until_ready((params, state, loss))
        times.append(time.perf_counter() - t)
      run["carry"] = (params, state)
      run["times"] += times
      run["rounds"].append(statistics.median(times))
  base = statistics.median(runs["no_loss_scale"]["times"])
  out = {
    "backend": jax.default_backend(),
    "params": int(sum(x.size for x in jax.tree.leaves(params0))),
    "batch": [args.batch_size, args.seq_len],
    "steps_timed": args.rounds * args.steps,
    "results": {},
  }
  for name, run in runs.items():
    med = statistics.median(run["times"])
    out["results"][name] = {"median_ms": med * 1e3, "ratio_to_no_loss_scale": med / base}
  for name in (RECOMPUTE + "+value_and_grad", RECOMPUTE + "+again"):
    row, base_run = out["results"][name], runs[RECOMPUTE]
    row["ratio_to_" + RECOMPUTE] = statistics.median(runs[name]["times"]) / statistics.median(
      base_run["times"]
    )
    row["paired_ratio_to_" + RECOMPUTE] = statistics.median(
      a / b for a, b in zip(runs[name]["rounds"], base_run["rounds"])
    )
  recomputed = out["results"][RECOMPUTE + "+value_and_grad"]
  # The common case: no step overflowed, so no pass was recomputed (nor skipped).
  m = optax_dls.metrics(runs[RECOMPUTE + "+value_and_grad"]["carry"][1])
  recomputed["recompute_tries"], recomputed["skip_count"] = (
    int(m["recompute_tries"]),
    int(m["skip_count"]),
  )
  print(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  main()
