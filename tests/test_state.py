"""LossScaleState: fixed dtypes from init, and the bookkeeping of one update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

INT32_MAX = np.iinfo(np.int32).max


def _state0():
  return optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, max_scale=2.0**10).init(
    {"w": jnp.ones(2)}
  )


def test_every_field_has_its_fixed_dtype_and_its_own_buffer():
  s = _state0()
  own = [f for f in s._fields if f not in ("overflows", "policy_state", "inner_state")]
  dtypes = {f: getattr(s, f).dtype for f in own}
  assert dtypes == {
    "loss_scale": jnp.float32,
    "num_steps": jnp.int32,
    "num_skipped": jnp.int32,
    "consecutive_skips": jnp.int32,
    "grad_norm": jnp.float32,
    "nonfinite": jnp.int32,
  }
  # The last non-finite step's record: none yet (one code per leaf, the loss's, the step).
  np.testing.assert_array_equal(s.nonfinite, [0, 0, 0])
  assert s.overflows == {} and bool(s.last_step_finite)
  assert np.isnan(float(s.grad_norm))
  leaves = jax.tree.leaves(s)
  assert len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves)  # donatable


def test_an_update_keeps_the_scale_in_range_and_saturates_the_counters():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=8.0, max_scale=2.0**10)
  s = _state0()._replace(
    loss_scale=jnp.float32(2.0**20),
    num_steps=jnp.int32(INT32_MAX),
    num_skipped=jnp.int32(INT32_MAX),
    consecutive_skips=jnp.int32(INT32_MAX),
  )
  new = tx.update({"w": jnp.full(2, jnp.inf)}, s)[1]
  assert float(new.loss_scale) == 2.0**10  # kept within max_scale
  assert int(new.num_steps) == int(new.num_skipped) == int(new.consecutive_skips) == INT32_MAX
  new = tx.update({"w": jnp.ones(2)}, new._replace(loss_scale=jnp.float32(0.25)))[1]
  assert (
    float(new.loss_scale) == 1.0 and int(new.consecutive_skips) == 0 and bool(new.last_step_finite)
  )
  assert [x.dtype for x in jax.tree.leaves(new)] == [x.dtype for x in jax.tree.leaves(s)]


def test_an_attribute_of_the_inner_state_read_on_the_loss_scale_state_says_where_it_went():
  tx = optax_dls.dynamic_loss_scale(optax.MultiSteps(optax.adam(0.1), every_k_schedule=2))
  state = tx.init({"w": jnp.ones(2)})
  with pytest.raises(AttributeError, match=r"'gradient_step'.*find_state\(opt_state\).inner_state"):
    state.gradient_step  # noqa: B018
  assert not hasattr(state, "gradient_step")
  assert optax.tree_utils.tree_get(state, "gradient_step") == 0
