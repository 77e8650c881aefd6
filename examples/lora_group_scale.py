"""A LoRA adapter on a frozen fp16 model: its gradients underflow with one global loss scale.

The base MLP (pre-trained here in float32 on scikit-learn's digits, then
frozen) runs in float16; its classifier head stays trainable, and two rank-4
adapters ``(h @ A @ B) * alpha / r`` on its hidden layers are fine-tuned with
it on a new labelling of the digits (label ``(y + 1) % 10``), with Adam under
``optax_dls.dynamic_loss_scale``. The global loss scale is capped by the
head's gradients (sums over the batch, the largest values of the backward
pass), while the adapter's scaling ``alpha / r`` is deliberately tiny
(``2**-32`` by default), which puts its gradients about 30 octaves below the
head's: the cotangent entering the adapter, ``ct * alpha / r``, flushes to zero
when cast to float16, and so do most adapter gradients. ``optax_dls.group_scale.group_scaled``
multiplies that cotangent by ``k`` where it is still float32 (at the adapter's
float32 output), so it enters the float16 branch as ``ct * alpha / r * k``, and
``optax_dls.group_scale.group_unscale`` divides the adapter gradients by ``k`` inside the
loss-scaled optimizer. The rest of the network is unaffected.

    python examples/lora_group_scale.py                       # one JSON line per run
    python examples/lora_group_scale.py --alpha 1e-7 --group-factor 65536

Reported: the fraction of adapter-gradient entries that are zero in float16
although the float32 gradient of the same batch at the same weights is not
(flushed to zero), the relative error of the unscaled adapter gradient against
that float32 gradient, the final loss, skipped steps and the loss scale.
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

SIZES = (64, 256, 256, 10)


def load_data():
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  perm = np.random.default_rng(0).permutation(len(x))
  return jnp.asarray(x[perm]), jnp.asarray(y[perm].astype(np.int32))


def init_base(key):
  keys = jax.random.split(key, len(SIZES) - 1)
  return [
    {"w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a), "b": jnp.zeros(b)}
    for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])
  ]


def init_adapters(key, rank):
  keys = jax.random.split(key, 4)
  return [
    {
      "down": jax.random.normal(keys[2 * i], (SIZES[i], rank)) / np.sqrt(SIZES[i]),
      "up": jax.random.normal(keys[2 * i + 1], (rank, SIZES[i + 1])) * 1e-2,
    }
    for i in range(2)
  ]


def lora_branch(adapter, h):
  return (h @ adapter["down"]) @ adapter["up"]


def forward(base, trainable, x, dtype, scaling, group_factor=None):
  """The base MLP with adapters on its hidden layers and the trainable head in place of its own."""
  cast = lambda t: jax.tree.map(lambda a: a.astype(dtype), t)
  base, trainable = cast(base), cast(trainable)
  # The group ends where the branch output turns float32, before alpha / r is
  # applied (in float32, as it can lie below the float16 range): the cotangent
  # reaches the group as a float32 ct * alpha / r, is multiplied by k there, and
  # enters the float16 branch as ct * alpha / r * k instead of flushing to zero.
  core = lambda adapter, h: lora_branch(adapter, h).astype(jnp.float32)
  core = optax_dls.group_scale.group_scaled(core, group_factor) if group_factor else core
  branch = lambda adapter, h: (core(adapter, h) * scaling).astype(dtype)
  h = x.astype(dtype)
  for i, layer in enumerate(base[:-1]):
    out = h @ layer["w"] + layer["b"]
    if trainable["adapters"]:
      out = out + branch(trainable["adapters"][i], h)
    h = jax.nn.relu(out)
  head = trainable["head"]
  return (h @ head["w"] + head["b"]).astype(jnp.float32)


def xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()


def pretrain(x, y, steps=300):
  base = init_base(jax.random.key(0))
  tx = optax.adam(3e-3)

  def step(carry, key):
    base, state = carry
    idx = jax.random.randint(key, (128,), 0, x.shape[0])
    loss = lambda b: xent(
      forward(b, {"adapters": [], "head": b[-1]}, x[idx], jnp.float32, 0.0), y[idx]
    )
    updates, state = tx.update(jax.grad(loss)(base), state)
    return (optax.apply_updates(base, updates), state), None

  keys = jax.random.split(jax.random.key(1), steps)
  (base, _), _ = jax.jit(lambda b: lax.scan(step, (b, tx.init(b)), keys))(base)
  return base


def finetune(base, x, y, args, group_factor):
  scaling = args.alpha / args.rank
  trainable = {"adapters": init_adapters(jax.random.key(2), args.rank), "head": base[-1]}
  inner = optax.adam(args.lr)
  if group_factor:
    is_adapter = lambda p: {
      "adapters": jax.tree.map(lambda _: True, p["adapters"]),
      "head": jax.tree.map(lambda _: False, p["head"]),
    }
    inner = optax.chain(optax_dls.group_scale.group_unscale(group_factor, is_adapter), inner)
  tx = optax_dls.dynamic_loss_scale(inner, growth_interval=args.growth_interval)
  y_new = (y + 1) % 10

  def step(carry, key):
    params, state = carry
    idx = jax.random.randint(key, (args.batch,), 0, x.shape[0])
    xb, yb = x[idx], y_new[idx]
    loss16 = lambda p: optax_dls.scale_loss(
      xent(forward(base, p, xb, jnp.float16, scaling, group_factor), yb), state
    )
    grads = jax.grad(loss16)(params)
    exact = jax.grad(lambda p: xent(forward(base, p, xb, jnp.float32, scaling), yb))(params)
    pairs = list(zip(jax.tree.leaves(grads["adapters"]), jax.tree.leaves(exact["adapters"])))
    flushed = sum(jnp.sum((g == 0) & (e != 0)) for g, e in pairs)
    nonzero = sum(jnp.sum(e != 0) for _, e in pairs)
    unscale = 1.0 / (optax_dls.find_state(state).loss_scale * (group_factor or 1.0))
    err = jnp.sqrt(
      sum(jnp.sum((g * unscale - e) ** 2) for g, e in pairs) / sum(jnp.sum(e**2) for _, e in pairs)
    )
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    finite = ~optax_dls.metrics(state)["skipped"]
    return (params, state), (
      jnp.where(finite, flushed / nonzero, jnp.nan),
      jnp.where(finite, err, jnp.nan),
      optax_dls.find_state(state).loss_scale,
    )

  keys = jax.random.split(jax.random.key(3), args.steps)
  (params, state), (flushed, err, scales) = jax.jit(
    lambda p: lax.scan(step, (p, tx.init(p)), keys)
  )(trainable)
  final = float(xent(forward(base, params, x, jnp.float32, scaling), y_new)) / x.shape[0]
  flushed = np.asarray(flushed)
  return {
    "group_factor": group_factor,
    "flushed_fraction_mean": round(float(np.nanmean(flushed)), 4),
    "flushed_fraction_last_100": round(float(np.nanmean(flushed[-100:])), 4),
    "adapter_grad_rel_error_mean": round(float(np.nanmean(np.asarray(err))), 4),
    "final_mean_loss": round(final, 4),
    "skipped": int(optax_dls.metrics(state)["skip_count"]),
    "log2_loss_scale_median": float(np.median(np.log2(np.asarray(scales)))),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--rank", type=int, default=4)
  parser.add_argument(
    "--alpha", type=float, default=2.0**-30, help="alpha / rank is the adapter scaling"
  )
  parser.add_argument("--growth-interval", type=int, default=50)
  parser.add_argument("--group-factor", type=float, default=2.0**24)
  args = parser.parse_args()
  x, y = load_data()
  base = pretrain(x, y)
  pre = (
    float(xent(forward(base, {"adapters": [], "head": base[-1]}, x, jnp.float32, 0.0), y))
    / x.shape[0]
  )
  print(json.dumps({"pretrained_base_mean_loss": round(pre, 4)}), flush=True)
  for factor in (None, args.group_factor):
    print(json.dumps(finetune(base, x, y, args, factor)), flush=True)


if __name__ == "__main__":
  main()
