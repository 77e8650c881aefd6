"""The no-op wrapper is bit-for-bit the bare inner optimizer, with the same state layout."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import jit_xla_defaults

import optax_dls


def _grads(params, key):
  keys = dict(zip(sorted(params), jax.random.split(key, len(params))))
  return jax.tree.map(lambda p, k: jax.random.normal(k, p.shape) * 1e-3, params, keys)


@pytest.mark.parametrize("grads_inside", [False, True])
def test_no_loss_scale_is_bare_adam_to_rounding_over_50_steps(grads_inside):
  """The bare optimizer to rounding (XLA contracts the multiply-adds around the product
  by 1/S otherwise), the gradients given or computed in the step."""
  params = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32), "b": jnp.ones((2, 3), jnp.float32)}
  bare, wrapped = optax.adam(3e-3), optax_dls.no_loss_scale(optax.adam(3e-3))

  def make_step(tx):
    @jit_xla_defaults  # the same program as the bare step's, as a user's is compiled
    def step(params, state, key, given):
      g = _grads(params, key) if grads_inside else given
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

    return step

  a, sa, step_a = params, bare.init(params), make_step(bare)
  b, sb, step_b = params, wrapped.init(params), make_step(wrapped)
  for i in range(50):
    key = jax.random.key(i)
    given = _grads(params, jax.random.fold_in(key, 1))
    a, sa = step_a(a, sa, key, given)
    b, sb = step_b(b, sb, key, given)
  assert not np.array_equal(np.asarray(a["w"]), np.asarray(params["w"]))
  inner = optax_dls.find_state(sb).inner_state
  for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, inner)), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=0)
  assert (
    float(optax_dls.find_state(sb).loss_scale) == 1.0
    and int(optax_dls.metrics(sb)["num_steps"]) == 50
  )
  # Same state layout as the dynamic wrapper: one training loop and checkpoint serve both.
  dyn = optax_dls.dynamic_loss_scale(optax.adam(3e-3)).init(params)
  assert jax.tree.structure(dyn) == jax.tree.structure(sb)


def test_no_loss_scale_measures_the_norm_of_huge_bf16_gradients():
  grads = {"w": jnp.array([1e20, -1e20], jnp.bfloat16)}
  # Measured only when asked: the bare optimizer's step measures nothing.
  quiet = optax_dls.no_loss_scale(optax.sgd(1.0))
  _, state = jax.jit(quiet.update)(grads, quiet.init(grads), grads)
  assert np.isnan(float(optax_dls.metrics(state)["grad_norm"]))
  tx = optax_dls.no_loss_scale(optax.sgd(1.0), track_grad_norm=True)
  _, state = jax.jit(tx.update)(grads, tx.init(grads), grads)
  expected = np.linalg.norm(np.asarray(grads["w"], np.float64))
  np.testing.assert_allclose(float(optax_dls.metrics(state)["grad_norm"]), expected, rtol=1e-6)
  dyn = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0)
  _, dstate = jax.jit(dyn.update)(grads, dyn.init(grads), grads)
  assert float(optax_dls.metrics(dstate)["grad_norm"]) == float(
    optax_dls.metrics(state)["grad_norm"]
  )


def test_dynamic_loss_scale_shows_the_policy_arguments_in_its_signature():
  params = inspect.signature(optax_dls.dynamic_loss_scale).parameters
  policy = inspect.signature(optax_dls.dynamic_policy).parameters
  assert list(params) == ["inner", *policy, "axis_name", "skip_lowering", "labels"]
  assert all(params[k].kind == inspect.Parameter.KEYWORD_ONLY for k in list(params)[1:])
  assert "__signature__" not in vars(optax_dls.dynamic_loss_scale)  # the real one
  assert all(params[k].default == policy[k].default for k in policy)


def test_after_a_reset_the_next_update_keeps_each_scaler_s_range():
  params = {"w": jnp.ones(2)}
  for tx, value, kept in [
    (optax_dls.no_loss_scale(optax.sgd(1.0)), 2.0, 1.0),
    (optax_dls.static_loss_scale(optax.sgd(1.0), 8.0), 4.0, 8.0),
    (
      optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**10, max_scale=2.0**12),
      2.0**13,
      2.0**12,
    ),
  ]:
    state = optax_dls.reset_scale(tx.init(params), value)
    assert float(optax_dls.find_state(state).loss_scale) == value
    updates, state = tx.update({"w": jnp.full(2, value)}, state, params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])  # unscaled by the reset value
    assert float(optax_dls.find_state(state).loss_scale) == kept
