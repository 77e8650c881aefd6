"""Dtypes: mixed gradient dtypes, float64, int and None leaves, stable state dtypes, one compile."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import enable_x64
from jax import lax

import optax_dls

S = 2.0**12


def _unscaled(g, compute=np.float32):
  """The contract's unscale, by hand: in float32 (or wider), cast back to g's dtype."""
  return (np.asarray(g).astype(compute) * (compute(1.0) / compute(S))).astype(g.dtype)


@pytest.mark.parametrize("gdtype", ["float16", "bfloat16", "float32"])
def test_f32_params_with_low_precision_grads_match_bare_adam(gdtype, lowering):
  params = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
  raw = jnp.array([0.1, -3.0, 1e-3], gdtype)
  grads = {"w": (raw.astype(jnp.float32) * S).astype(gdtype)}
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=S, skip_lowering=lowering)
  bare = optax.adam(1e-2)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  # A half-precision gradient of a float32 parameter is unscaled into float32: nothing below
  # the half format's smallest number is flushed again.
  u = {"w": grads["w"].astype(jnp.float32) * jnp.float32(1.0 / S)}
  assert u["w"].dtype == jnp.float32
  bupdates, bstate = jax.jit(bare.update)(u, bare.init(params), params)
  assert bool(state.last_step_finite)
  np.testing.assert_array_equal(updates["w"], bupdates["w"])
  assert updates["w"].dtype == bupdates["w"].dtype
  assert optax.apply_updates(params, updates)["w"].dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(bstate)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def test_f64_grads_unscaled_in_f64_under_x64(lowering):
  with enable_x64(True):
    params = {"w": jnp.array([0.5, -1.0], jnp.float64)}
    g = jnp.array([1.0 / 3.0, 1e-300], jnp.float64) * S  # 1e-300 is below float32 range
    tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=S, skip_lowering=lowering)
    state0 = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": g}, state0, params)
    assert updates["w"].dtype == jnp.float64
    np.testing.assert_array_equal(updates["w"], -_unscaled(g, np.float64))
    assert float(updates["w"][1]) != 0.0
    for a, b in zip(jax.tree.leaves(state0), jax.tree.leaves(state)):
      assert a.dtype == b.dtype  # loss_scale stays float32, counters int32
    assert state.loss_scale.dtype == jnp.float32
    _, state = jax.jit(tx.update)({"w": g.at[0].set(jnp.nan)}, state, params)
    assert not bool(state.last_step_finite)


def test_int_and_none_leaves_pass_through(lowering):
  grads = {
    "f": jnp.array([1.0, 2.0]) * S,
    "i": jnp.array([7, -3], jnp.int32),
    "n": None,
    "b": jnp.array(True),
  }
  for tx in (
    optax_dls.dynamic_loss_scale(optax.identity(), init_scale=S, skip_lowering=lowering),
    optax_dls.static_loss_scale(optax.identity(), S, skip_lowering=lowering),
  ):
    step = jax.jit(tx.update)
    state = tx.init(grads)
    updates, state = step(grads, state)
    np.testing.assert_array_equal(updates["f"], [1.0, 2.0])
    np.testing.assert_array_equal(updates["i"], grads["i"])
    assert updates["i"].dtype == jnp.int32 and updates["n"] is None and bool(updates["b"])
    bad = dict(grads, f=grads["f"].at[0].set(jnp.inf))
    skipped, state = step(bad, state)  # same compiled program, same output types
    assert jax.tree.structure(skipped) == jax.tree.structure(updates)
    assert [x.dtype for x in jax.tree.leaves(skipped)] == [
      x.dtype for x in jax.tree.leaves(updates)
    ]
    assert not any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(skipped))
    assert not bool(state.last_step_finite)
    assert step._cache_size() == 1


def _types(tree):
  return jax.tree.map(lambda x: (x.dtype, x.shape, x.weak_type), tree)


def test_state_dtypes_unchanged_after_scan_over_100_steps(lowering):
  params = {"w": jnp.zeros(4, jnp.float32)}
  tx = optax_dls.dynamic_loss_scale(
    optax.adam(1e-3), init_scale=2.0**4, growth_interval=3, hysteresis=2, skip_lowering=lowering
  )
  state0 = tx.init(params)
  # Every 7th step has an inf: growth, hysteresis and backoff all happen.
  gs = jnp.ones((100, 4), jnp.float16).at[::7, 1].set(jnp.inf)

  def body(carry, g):
    params, state = carry
    g = g * optax_dls.find_state(state).loss_scale.astype(jnp.float16)
    updates, state = tx.update({"w": g}, state, params)
    return (optax.apply_updates(params, updates), state), state.loss_scale

  (params, state), scales = jax.jit(lambda c: lax.scan(body, c, gs))((params, state0))
  assert _types(state) == _types(state0)
  # 15 injected infs, plus real fp16 overflows of 1 * S once S reaches 2**16.
  assert int(state.num_steps) == 100 and int(state.num_skipped) > 15
  assert float(state.loss_scale) <= 2.0**15 and float(jnp.max(scales)) == 2.0**16
  assert len(set(np.asarray(scales).tolist())) > 2  # the scale really moved
  assert params["w"].dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(params["w"])))


def test_jitted_update_compiles_once_over_10_steps(lowering):
  traces = []
  params = {"w": jnp.zeros(3, jnp.float32)}
  tx = optax_dls.dynamic_loss_scale(
    optax.adam(1e-3), init_scale=4.0, growth_interval=2, skip_lowering=lowering
  )

  @jax.jit
  def step(params, state, g):
    traces.append(1)  # Python side effect: runs once per trace
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state, optax_dls.metrics(state)

  state = tx.init(params)
  for i in range(10):
    g = {"w": jnp.full(3, jnp.inf if i % 4 == 1 else 1.0, jnp.float32)}
    params, state, _ = step(params, state, g)
  assert len(traces) == 1 and step._cache_size() == 1
  assert int(state.num_skipped) == 3 and int(state.num_steps) == 10
