"""Compile seconds of the main example's whole fp16 train step, each variant in a new process.

The step of ``train_step_e2e.py`` (examples/lm's model, forward, backward, AdamW with
clipping) under ``no_loss_scale``, under ``dynamic_loss_scale`` (``skip_lowering="auto"``),
and a floor: ``no_loss_scale`` plus only the one-read all-finite check of the gradients
(:func:`optax_dls.all_finite`: a float32 sum of squares per leaf, the exact path in a
``lax.cond``) feeding the skip decision, the new parameters and optimizer state selected by
``jnp.where``. The flag comes out of the conditional: written as a plain function of the
per-leaf sums (``jnp.isfinite(jnp.sum(jnp.stack(sums)))``), XLA's CPU fusion copies that
scalar computation, with every leaf's reduction as an operand, into each of the few hundred
selected outputs' kernels, and the 8-layer step compiled in 40-70 s. Each variant is
lowered and compiled in a new Python process (XLA reuses kernels within a process), the
variants interleaved, 3 runs each; the child's CPU seconds (``time.process_time``, less
disturbed by other work on a shared machine) and wall seconds, their medians and the
ratios of the CPU medians are printed as one JSON object. Usage::

    python benchmarks/train_step_compile.py [--layers 2,8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
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
    finite = optax_dls.all_finite(grads)  # one read of each leaf; exact path in a cond
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state), loss

  step = jax.jit(step, donate_argnums=(0, 1))
else:
  tx = e.VARIANTS[name]()
  step = e.make_step(model, tx)
state = tx.init(params)
w, c = time.perf_counter(), time.process_time()
step.lower(params, state, batch).compile()
print(time.perf_counter() - w, time.process_time() - c)
"""
VARIANTS = ("no_loss_scale", "dynamic_loss_scale", "floor")


def fresh_compile_seconds(name: str, layers: int) -> tuple[float, float]:
  """``(wall, cpu)`` seconds to lower and compile the ``layers``-layer step of variant
  ``name`` in a new Python process."""
  here = os.path.dirname(os.path.abspath(__file__))
  code = CHILD.format(here=here, layers=layers, name=name)
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  wall, cpu = out.stdout.split()[-2:]
  return float(wall), float(cpu)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", default="2,8", help="comma-separated layer counts")
  ap.add_argument("--repeats", type=int, default=3, help="new processes per variant")
  args = ap.parse_args(argv)
  result = {}
  for layers in [int(n) for n in args.layers.split(",")]:
    cpu: dict = {name: [] for name in VARIANTS}
    wall: dict = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
      for name in VARIANTS:
        w, c = fresh_compile_seconds(name, layers)
        wall[name].append(w)
        cpu[name].append(c)
    med = {name: statistics.median(t) for name, t in cpu.items()}
    dls = med["dynamic_loss_scale"]
    result[f"{layers}_layers"] = {
      "compile_cpu_s": med,
      "compile_wall_s": {name: statistics.median(t) for name, t in wall.items()},
      "runs_cpu_s": cpu,
      "runs_wall_s": wall,
      "dynamic_over_no_loss_scale": dls / med["no_loss_scale"],
      "dynamic_over_floor": dls / med["floor"],
      "floor_over_no_loss_scale": med["floor"] / med["no_loss_scale"],
    }
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
