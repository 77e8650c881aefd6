"""Compile seconds of the main example's whole fp16 train step, each variant in a new process.

The step of ``train_step_e2e.py`` (examples/lm's model, forward, backward, AdamW with
clipping) under ``no_loss_scale``, under ``dynamic_loss_scale`` (``skip_lowering="auto"``),
and a floor: ``no_loss_scale`` plus only a one-read all-finite check of the gradients (their
sum of squares) feeding the skip decision (the gradients multiplied by 0 where it is not
finite, so that the update waits for the read). Each variant is lowered and compiled in a
new Python process (XLA reuses kernels within a process), the variants interleaved, 3 runs
each; the medians and their ratios are printed as one JSON object. Usage::

    python benchmarks/train_step_compile.py [--layers 2,8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import sys, time
sys.path.insert(0, {here!r})
import jax, jax.numpy as jnp, numpy as np, optax, optax_dls
import train_step_e2e as e
model = e.Transformer(128, {layers}, 4, 64, e.FP16)
params = model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"]
batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, 65)), jnp.int32)
name = {name!r}
if name == "floor":
  tx = e.VARIANTS["no_loss_scale"]()

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: e.loss_fn(model, p, batch))(params)
    read = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    keep = jnp.where(jnp.isfinite(read), 1.0, 0.0)
    grads = jax.tree.map(lambda g: (g * keep).astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
else:
  tx = e.VARIANTS[name]()
  step = e.make_step(model, tx)
state = tx.init(params)
t = time.perf_counter()
step.lower(params, state, batch).compile()
print(time.perf_counter() - t)
"""
VARIANTS = ("no_loss_scale", "dynamic_loss_scale", "floor")


def fresh_compile_seconds(name: str, layers: int) -> float:
  """Seconds to lower and compile the ``layers``-layer step of variant ``name`` in a new
  Python process."""
  here = __file__.rsplit("/", 1)[0]
  code = CHILD.format(here=here, layers=layers, name=name)
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  return float(out.stdout.split()[-1])


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", default="2,8", help="comma-separated layer counts")
  ap.add_argument("--repeats", type=int, default=3, help="new processes per variant")
  args = ap.parse_args(argv)
  result = {}
  for layers in [int(n) for n in args.layers.split(",")]:
    times: dict = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
      for name in VARIANTS:
        times[name].append(fresh_compile_seconds(name, layers))
    med = {name: statistics.median(t) for name, t in times.items()}
    dls = med["dynamic_loss_scale"]
    result[f"{layers}_layers"] = {
      "compile_fresh_s": med,
      "runs_s": times,
      "dynamic_over_no_loss_scale": dls / med["no_loss_scale"],
      "dynamic_over_floor": dls / med["floor"],
      "floor_over_no_loss_scale": med["floor"] / med["no_loss_scale"],
    }
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
