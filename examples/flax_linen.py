"""A flax linen MLP on scikit-learn's handwritten digits, fp16 compute with dynamic loss scaling.

    python examples/flax_linen.py                 # about 15 s on 2 CPU cores
    python examples/flax_linen.py --steps 50

Float32 master parameters, float16 matmuls and activations, float32 loss
(Micikevicius et al. 2018, *Mixed Precision Training*). The initial loss scale
2**24 is deliberately too large: the first steps overflow in float16, are
skipped, and the scale backs off until the gradients fit. ``TrainState.step``
counts those skipped steps too; ``num_steps - skip_count`` of
``optax_dls.metrics`` does not.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from sklearn.datasets import load_digits

import optax_dls
import optax_dls.flax


class MLP(nn.Module):
  hidden: int = 128

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden, dtype=jnp.float16, param_dtype=jnp.float32)(x))
    return nn.Dense(10, dtype=jnp.float16, param_dtype=jnp.float32)(x).astype(jnp.float32)


def load(seed=0):
  """Digits as (x_train, y_train, x_test, y_test): float16 images in [0, 1], int32 labels."""
  x, y = load_digits(return_X_y=True)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = (x[order] / 16.0).astype(np.float16), y[order].astype(np.int32)
  return x[:1500], y[:1500], x[1500:], y[1500:]


def loss_fn(params, apply_fn, x, y):
  logits = apply_fn({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


grad_fn = optax_dls.flax.value_and_grad(loss_fn, has_aux=True)  # reads S from the state it is given


@jax.jit
def train_step(state, x, y):
  ((loss, logits), grads), state = grad_fn(state, state.params, state.apply_fn, x, y)  # grads x S
  # Unscale, check, skip or apply, adapt S.
  state = state.apply_gradients(grads=grads)
  return state, loss, jnp.mean(jnp.argmax(logits, -1) == y)


@jax.jit
def accuracy(state, x, y):
  return jnp.mean(jnp.argmax(state.apply_fn({"params": state.params}, x), -1) == y)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--log-every", type=int, default=50)
  args = p.parse_args(argv)

  x_tr, y_tr, x_te, y_te = load()
  model = MLP()
  params = model.init(jax.random.key(0), x_tr[:1])["params"]
  tx = optax_dls.dynamic_loss_scale(optax.adam(3e-3), init_scale=2.0**24, growth_interval=100)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  rng = np.random.default_rng(1)
  for i in range(1, args.steps + 1):
    idx = rng.integers(0, len(x_tr), args.batch)
    state, loss, acc = train_step(state, x_tr[idx], y_tr[idx])
    if i % args.log_every == 0 or i == args.steps:
      m = optax_dls.metrics(state.opt_state)
      print(
        f"step {int(state.step):4d}  loss {float(loss):.4f}  batch acc {float(acc):.3f}  "
        f"loss scale {float(m['loss_scale']):.0f}  skipped {int(m['skip_count'])}  "
        f"applied {int(m['num_steps'] - m['skip_count'])}"
      )
  test_acc = float(accuracy(state, x_te, y_te))
  print(f"test accuracy {test_acc:.3f}")
  m = optax_dls.metrics(state.opt_state)
  return {
    "loss": float(loss),
    "test_accuracy": test_acc,
    "steps": int(state.step),
    "skip_count": int(m["skip_count"]),
    "loss_scale": float(m["loss_scale"]),
  }


if __name__ == "__main__":
  main()
