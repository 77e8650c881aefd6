"""docs/troubleshooting.md: what "Gradients always small" and "Scale never grows" say."""

import jax.numpy as jnp
import numpy as np
import optax

import optax_dls


def test_without_scale_loss_every_update_is_s_times_too_small():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**10)
  params = {"w": jnp.zeros(2)}
  unscaled = {"w": jnp.array([1.0, -2.0])}  # the loss was not multiplied by S
  updates, _ = tx.update(unscaled, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], -np.asarray(unscaled["w"]) / 2.0**10)


def test_static_loss_scale_never_grows():
  tx = optax_dls.static_loss_scale(optax.sgd(1.0), 2.0**8)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for _ in range(5):
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert float(optax_dls.find_state(state).loss_scale) == 2.0**8


def test_with_multi_steps_inside_growth_counts_micro_batches_not_windows():
  tx = optax_dls.dynamic_loss_scale(
    optax.MultiSteps(optax.sgd(1.0), every_k_schedule=4), init_scale=2.0**4, growth_interval=4
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for _ in range(4):  # four micro-batches: one window
    _, state = tx.update({"w": jnp.ones(2) * optax_dls.find_state(state).loss_scale}, state, params)
  assert float(optax_dls.find_state(state).loss_scale) == 2.0**5
