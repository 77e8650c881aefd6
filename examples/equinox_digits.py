"""An Equinox MLP on scikit-learn's handwritten digits, fp16 compute with dynamic loss scaling.

    python examples/equinox_digits.py             # a few seconds on 2 CPU cores
    python examples/equinox_digits.py --steps 200

Float32 master weights; each step casts the floating arrays of the model to float16
inside the differentiated function (its activation function, a leaf of the model, is
left alone), runs the forward and backward passes in float16 and the loss in float32;
the gradients of the float32 weights come back float32 through the cast. (A model cast
to float16 outside the differentiated function gives float16 gradients, which the
update unscales into float32, so no small gradient is flushed again.) value_and_grad
recomputes an overflowing step at the backed-off scale (max_tries), so a record of a
non-finite step does not always mean a skipped one.
The initial loss scale 2**24 is deliberately too large: the first steps overflow in
float16, are skipped, and the scale backs off.
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import optax_dls


def half(tree):
  """``tree`` with its floating arrays in float16; every other leaf untouched."""
  cast = lambda x: x.astype(jnp.float16) if eqx.is_inexact_array(x) else x
  return jax.tree.map(cast, tree)


def load(seed=0):
  """Digits as (x_train, y_train, x_test, y_test): float32 images in [0, 1], int32 labels."""
  x, y = load_digits(return_X_y=True)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
  n = int(0.8 * len(x))
  return x[:n], y[:n], x[n:], y[n:]


def loss_fn(model, x, y):
  """Float32 cross-entropy of the float16 forward pass of ``model`` (float32 weights)."""
  logits = jax.vmap(half(model))(x.astype(jnp.float16)).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--log-every", type=int, default=20)
  parser.add_argument("--batch", type=int, default=128)
  args = parser.parse_args(argv)

  x_train, y_train, x_test, y_test = load()
  model = eqx.nn.MLP(64, 10, 128, 1, activation=jax.nn.relu, key=jax.random.key(0))
  tx = optax_dls.dynamic_loss_scale(optax.adam(3e-3), init_scale=2.0**24)
  state = tx.init(eqx.filter(model, eqx.is_array))
  grad_fn = optax_dls.value_and_grad(loss_fn, tx)

  @eqx.filter_jit
  def step(model, state, x, y):
    (loss, grads), state = grad_fn(state, model, x, y)  # float32 gradients, scaled
    updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, state, loss

  rng = np.random.default_rng(1)
  loss = jnp.nan
  for i in range(1, args.steps + 1):
    idx = rng.integers(0, len(x_train), args.batch)
    model, state, loss = step(model, state, x_train[idx], y_train[idx])
    if i % args.log_every == 0 or i == args.steps:
      m = optax_dls.metrics(state)
      print(
        f"step {i:4d}  loss {float(loss):.4f}  loss scale {float(m['loss_scale']):.0f}"
        f"  skipped {int(m['skip_count'])}"
      )
  logits = jax.vmap(half(model))(jnp.asarray(x_test, jnp.float16))
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  m = optax_dls.metrics(state)
  print(f"test accuracy {accuracy:.3f}")
  return {
    "steps": args.steps,
    "loss": float(loss),
    "accuracy": accuracy,
    "loss_scale": float(m["loss_scale"]),
    "skip_count": int(m["skip_count"]),
  }


if __name__ == "__main__":
  main()
