"""An inner transformation built from module-level functions, so that it pickles."""

import jax
import optax


def init(params):
  return {"m": jax.tree.map(lambda p: p * 0, params), "count": optax.safe_int32_increment(0)}


def update(updates, state, params=None):
  del params
  m = jax.tree.map(lambda m, g: 0.5 * m + g, state["m"], updates)
  out = jax.tree.map(lambda m: -0.1 * m, m)
  return out, {"m": m, "count": optax.safe_int32_increment(state["count"])}


INNER = optax.GradientTransformation(init, update)
