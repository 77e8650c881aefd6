"""The whole optimizer state can be donated to a jitted step."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dls


@pytest.mark.parametrize("make", [
    lambda: optax_dls.dynamic_loss_scale(optax.adam(1e-3), hysteresis=2),
    lambda: optax_dls.static_loss_scale(optax.adam(1e-3), 8.0),
    lambda: optax_dls.no_loss_scale(optax.adam(1e-3)),
])
def test_state_buffers_are_distinct_and_donatable(make):
  tx = make()
  params = {"w": jnp.ones((4,)), "b": jnp.zeros(())}
  state = tx.init(params)
  leaves = jax.tree.leaves(state)
  pointers = [x.unsafe_buffer_pointer() for x in leaves]
  assert len(set(pointers)) == len(pointers)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  grads = jax.tree.map(jnp.ones_like, params)
  for _ in range(3):
    params, state = step(params, state, grads)
  assert int(state.num_steps) == 3
