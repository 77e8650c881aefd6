"""The one-read finite check stays exact at its edges: huge finite values, scales below 1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls


def _step(tx, grads):
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  return updates, state


def test_huge_finite_gradients_are_finite_and_applied():
  grads = {"w": jnp.array([1e30, -3e38], jnp.float32), "h": jnp.array([65504.0], jnp.float16)}
  updates, state = _step(optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0, alerts=False), grads)
  assert bool(state.last_step_finite)
  np.testing.assert_array_equal(np.asarray(updates["w"]), -np.asarray(grads["w"]))
  assert float(state.grad_norm) == np.inf  # the squares overflow float32; the step is still applied


@pytest.mark.parametrize("make", [
    lambda: optax_dls.static_loss_scale(optax.sgd(1.0), 0.5, alerts=False),
    lambda: optax_dls.loss_scaled(optax.sgd(1.0), optax_dls.static_policy(0.5), alerts=False),
], ids=["static", "policy_without_min_scale"])
@pytest.mark.parametrize("value, finite", [(30000.0, True), (40000.0, False)])
def test_scale_below_one_unscaling_overflow_is_caught(make, value, finite):
  # u = g / 0.5: 60000 fits float16, 80000 overflows it to inf.
  updates, state = _step(make(), {"h": jnp.array([value], jnp.float16)})
  assert bool(state.last_step_finite) is finite
  expected = -2.0 * value if finite else 0.0
  np.testing.assert_array_equal(np.asarray(updates["h"], np.float32), np.float32(expected))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_one_bad_entry_among_huge_ones_is_caught(bad, dtype):
  big = float(jnp.finfo(dtype).max)
  grads = {"a": jnp.full((5,), big, dtype), "b": jnp.array([1.0, bad], dtype)}
  _, state = _step(optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0, alerts=False), grads)
  assert not bool(state.last_step_finite)
