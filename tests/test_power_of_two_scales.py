"""docs/guide/comparison.md: with the default initial scale, factors, floor and ceiling,
every scale of the dynamic policy is a power of two, at the ceiling and the floor too."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls


def test_default_dynamic_scales_are_powers_of_two_up_to_the_ceiling_and_down_to_the_floor():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=1)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales = [float(optax_dls.find_state(state).loss_scale)]
  for finite in [True] * 12 + [False] * 28 + [True] * 3:
    grads = {"w": jnp.array([1.0, 1.0 if finite else jnp.inf])}
    _, state = update(grads, state, params)
    scales.append(float(optax_dls.find_state(state).loss_scale))
  log2 = np.log2(scales)
  assert np.array_equal(log2, np.round(log2)), scales
  assert max(scales) == 2.0**24 and min(scales) == 1.0 and scales[0] == 2.0**15
