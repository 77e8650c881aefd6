"""A user-written LossScalePolicy runs through loss_scaled like a built-in one."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls


class MyState(NamedTuple):
  clean: jax.Array  # int32: finite steps since the last change
  seen: jax.Array  # float32 (3,): (step, grad_norm, amax) of the last GradStats


def my_policy(init_scale=2.0**10, every=2, amax_limit=2.0**14):
  """Double every `every` clean steps, halve on overflow or when a scaled gradient nears the limit."""

  def init():
    return jnp.float32(init_scale), MyState(jnp.zeros([], jnp.int32), jnp.zeros(3, jnp.float32))

  def update(scale, state, stats):
    clean = jnp.where(stats.finite, state.clean + 1, 0)
    grow = clean >= every
    shrink = ~stats.finite | (stats.amax > amax_limit)
    scale = jnp.where(shrink, scale / 2, jnp.where(grow, scale * 2, scale))
    seen = jnp.stack([stats.step.astype(jnp.float32), stats.grad_norm, stats.amax])
    return scale.astype(jnp.float32), MyState(jnp.where(grow | shrink, 0, clean).astype(jnp.int32), seen)

  return optax_dls.LossScalePolicy(init, update, stats=("amax",))


def test_custom_policy_through_loss_scaled():
  params = {"w": jnp.zeros(2, jnp.float32)}
  tx = optax_dls.loss_scaled(optax.adam(1e-2), my_policy(), alerts=False)

  @jax.jit
  def step(params, state, g):
    g = {"w": g * optax_dls.loss_scale(state)}
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state, scales, inner = tx.init(params), [], []
  # unscaled gradients: two clean, one overflow, one clean, then one whose scaled amax
  # (20 * 2**10 = 20480) passes the limit, then a clean one.
  for g in ([1.0, 2.0], [3.0, 4.0], [np.inf, 1.0], [1.0, 1.0], [20.0, 1.0], [1.0, 1.0]):
    before = state.inner_state
    params, state = step(params, state, jnp.array(g, jnp.float32))
    scales.append(float(optax_dls.loss_scale(state)))
    inner.append(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state.inner_state, before))
  assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**9, 2.0**9]
  assert all(jax.tree.leaves(inner[2])) and not all(jax.tree.leaves(inner[3]))  # skip left it
  step_seen, norm_seen, amax_seen = np.asarray(state.policy_state.seen)
  assert step_seen == 5 and norm_seen == np.float32(np.sqrt(2.0)) and amax_seen == 2.0**9
  m = optax_dls.metrics(state)
  assert int(m["skip_count"]) == 1 and bool(jnp.all(jnp.isfinite(params["w"])))
