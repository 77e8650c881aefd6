"""Skipped steps and final loss of loss-scale policies on one fp16 run with learning-rate spikes.

A small MLP (float32 master weights, float16 compute) learns scikit-learn's
digits with Adam; every ``--spike-every`` applied steps the learning rate jumps
by ``--spike-factor`` for ``--spike-len`` steps, so the weights, and with them
the gradients, grow for a while and come back. The loss is summed over the
batch, so the gradients sit close to the float16 range at the usual scales. The default
dynamic policy
learns the safe scale only by overflowing (each overflow is a skipped step);
the gradient-aware ``amax_policy`` sees the amax rise and backs off first.

    python examples/policy_comparison.py                 # prints one JSON line per policy
    python examples/policy_comparison.py --steps 6000 --seed 1

Every policy sees the same batches and the same schedule (indexed by applied
steps, since a skipped step does not advance Adam or its schedule).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from sklearn.datasets import load_digits

import optax_dls

F16 = jnp.float16


def load_data():
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0 - 0.3).astype(np.float32)
  perm = np.random.default_rng(0).permutation(len(x))
  x, y = x[perm], y[perm].astype(np.int32)
  cut = int(0.8 * len(x))
  return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def init_params(key, sizes=(64, 256, 256, 10)):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (a, b), jnp.float32) * np.sqrt(2.0 / a), "b": jnp.zeros(b)}
    for k, a, b in zip(keys, sizes[:-1], sizes[1:])
  ]


def forward(params, x, dtype):
  h = x.astype(dtype)
  for i, layer in enumerate(params):
    h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
    if i < len(params) - 1:
      h = jax.nn.relu(h)
  return h.astype(jnp.float32)


def xent(params, x, y, dtype, reduce=jnp.mean):
  logits = forward(params, x, dtype)
  return reduce(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def schedule(lr, every, length, factor):
  """``lr``, raised geometrically to ``lr * factor`` and back over ``length`` steps,
  from every ``every``-th applied step on (a triangular spike in log space)."""

  def fn(count):
    phase = (count % every).astype(jnp.float32) / (length / 2)
    tri = jnp.where(phase < 2, 1 - jnp.abs(phase - 1), 0.0)
    return lr * jnp.where(count >= every, factor**tri, 1.0)

  return fn


POLICIES = {
  "dynamic (default)": lambda: optax_dls.dynamic_policy(),
  "dynamic (growth_interval=200)": lambda: optax_dls.dynamic_policy(growth_interval=200),
  "amax (default, margin=2)": lambda: optax_dls.amax_policy(),
  "amax (margin=1)": lambda: optax_dls.amax_policy(margin=1),
}


def run(policy, args, data):
  (xtr, ytr), (xte, yte) = data
  lr = schedule(args.lr, args.spike_every, args.spike_len, args.spike_factor)
  tx = optax_dls.loss_scaled(optax.adam(lr), policy)
  params = init_params(jax.random.key(args.seed))
  xtr, ytr = jnp.asarray(xtr), jnp.asarray(ytr)

  def step(carry, key):
    params, state = carry
    idx = jax.random.randint(key, (args.batch,), 0, xtr.shape[0])
    # Summed over the batch (as token-summed LM losses are): gradients ~2**7 larger.
    loss_fn = lambda p: optax_dls.scale_loss(xent(p, xtr[idx], ytr[idx], F16, jnp.sum), state)
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    m = optax_dls.metrics(state)
    return (params, state), (m["loss_scale"], m["skipped"])

  keys = jax.random.split(jax.random.key(args.seed + 1), args.steps)
  train = jax.jit(lambda p, s: lax.scan(step, (p, s), keys))
  (params, _state), (scales, skipped) = train(params, tx.init(params))
  skipped = np.asarray(skipped)
  final = float(xent(params, jnp.asarray(xte), jnp.asarray(yte), jnp.float32))
  train_loss = float(xent(params, xtr, ytr, jnp.float32))
  acc = float(jnp.mean(jnp.argmax(forward(params, jnp.asarray(xte), jnp.float32), -1) == yte))
  return {
    "skipped": int(skipped.sum()),
    "skipped_first_50": int(skipped[:50].sum()),
    "final_train_loss": round(train_loss, 4),
    "final_test_loss": round(final, 4),
    "test_accuracy": round(acc, 4),
    "final_loss_scale": float(scales[-1]),
    "log2_loss_scale_median": float(np.median(np.log2(scales))),
    "log2_loss_scale_min": float(np.log2(np.min(scales))),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--spike-every", type=int, default=400)
  parser.add_argument("--spike-len", type=int, default=80)
  parser.add_argument("--spike-factor", type=float, default=30.0)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  data = load_data()
  for name, make in POLICIES.items():
    print(json.dumps({"policy": name, **run(make(), args, data)}), flush=True)


if __name__ == "__main__":
  main()
