"""The behavioural contract of one update (docs/design.md), rule by rule, under jax.jit and
each lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls

INT32_MAX = np.iinfo(np.int32).max


def _stepper(tx, params):
  """A jitted update that returns (updates, new_state); compiled once per tx."""
  return jax.jit(lambda g, s: tx.update(g, s, params))


def _scales(tx, params, grads_seq):
  step, state, out = _stepper(tx, params), tx.init(params), []
  for g in grads_seq:
    _, state = step(g, state)
    out.append(float(state.loss_scale))
  return out, state


def _g(v):
  return {"w": jnp.array([v, 1.0], jnp.float32)}


F, I = _g(1.0), _g(np.inf)
P = {"w": jnp.zeros(2, jnp.float32)}


def test_rule1_unscale_with_the_scale_the_loss_used(lowering):
  """u = g * (1/S) in float32, cast back per leaf; int, bool and None untouched; old S."""
  s = 2.0**10
  # growth_interval=1: S grows on this very step; the unscale must still use the old S.
  tx = optax_dls.dynamic_loss_scale(
    optax.identity(), init_scale=s, growth_interval=1, skip_lowering=lowering
  )
  grads = {
    "f32": jnp.array([3.0, -7.5, 1e-3], jnp.float32) * s,
    "f16": jnp.array([0.1, 3.0], jnp.float16) * jnp.float16(s),
    "bf16": jnp.array([0.1, -2.0], jnp.bfloat16) * jnp.bfloat16(s),
    "i": jnp.array([3, 4], jnp.int32),
    "b": jnp.array([True, False]),
    "none": None,
  }
  state = tx.init(grads)
  updates, state = _stepper(tx, grads)(grads, state)
  inv = np.float32(1.0) / np.float32(s)
  for k in ("f32", "f16", "bf16"):
    expect = (np.asarray(grads[k]).astype(np.float32) * inv).astype(grads[k].dtype)
    assert updates[k].dtype == grads[k].dtype
    np.testing.assert_array_equal(np.asarray(updates[k]), expect)
  np.testing.assert_array_equal(updates["i"], grads["i"])
  assert updates["i"].dtype == jnp.int32
  np.testing.assert_array_equal(updates["b"], grads["b"])
  assert updates["none"] is None
  assert float(state.loss_scale) == 2 * s  # it did grow on this step


def test_rule2_finite_check_is_exact_and_reduced_over_axis_name(lowering):
  tx = optax_dls.static_loss_scale(optax.identity(), 1.0, skip_lowering=lowering)
  step = _stepper(tx, None)
  big = {
    "a": jnp.array([3e38, -3e38], jnp.float32),
    "b": jnp.array([65504.0], jnp.float16),
    "c": jnp.array([3e38], jnp.bfloat16),
  }
  state = tx.init(big)
  _, s = step(big, state)
  assert bool(s.last_step_finite)
  for bad in (np.inf, -np.inf, np.nan):
    for leaf in big:
      g = dict(big, **{leaf: big[leaf].at[0].set(bad)})
      _, s = step(g, state)
      assert not bool(s.last_step_finite), (leaf, bad)

  # With axis_name under shard_map: inf in one device's shard makes every device skip.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  P_ = jax.sharding.PartitionSpec
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=4.0, axis_name="d", skip_lowering=lowering
  )
  st0 = tx.init({"w": jnp.zeros(1)})

  def local(g, state):
    _, state = tx.update({"w": g}, state, None)
    return state.last_step_finite[None], state.loss_scale[None]

  f = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P_("d"), P_()), out_specs=(P_("d"), P_("d")))
  )
  finite, scales = f(jnp.ones(8).at[6].set(jnp.inf), st0)
  assert not np.any(np.asarray(finite)) and np.all(np.asarray(scales) == 2.0)
  finite, scales = f(jnp.ones(8), st0)
  assert np.all(np.asarray(finite)) and np.all(np.asarray(scales) == 4.0)


def test_rule3_inner_update_only_on_finite_and_never_sees_nonfinite(lowering):
  seen = []

  def update(u, state, params=None):
    jax.debug.callback(lambda x: seen.append(bool(np.all(np.isfinite(x)))), u["w"])
    return jax.tree.map(lambda x: -x, u), state + 1

  inner = optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update)
  tx = optax_dls.dynamic_loss_scale(inner, init_scale=2.0, skip_lowering=lowering)
  step = _stepper(tx, P)
  state = tx.init(P)
  updates, state = step({"w": jnp.array([2.0, 4.0])}, state)
  np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])
  before = state
  for bad in (np.inf, -np.inf, np.nan):
    updates, state = step({"w": jnp.array([bad, 4.0])}, state)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_array_equal(updates["w"], np.zeros(2, np.float32))
    assert int(state.inner_state) == int(before.inner_state) == 1
  jax.effects_barrier()
  # It never saw a non-finite value: under cond it ran on the finite step only; under where it
  # ran every step, on zeros when skipped, and the selection discarded what it returned.
  assert seen == [True] * (1 if lowering == "cond" else 4)


def test_rule4_growth_on_the_interval_th_clean_step_capped_and_after_warmup(lowering):
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=4.0, growth_interval=3, max_scale=16.0, skip_lowering=lowering
  )
  scales, state = _scales(tx, P, [F] * 10)
  assert scales == [4, 4, 8, 8, 8, 16, 16, 16, 16, 16]
  assert int(state.policy_state.growth_tracker) == 1  # reset on growth, including capped growth
  # warmup_steps: no growth while fewer than 4 updates ran before this one.
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=4.0, growth_interval=1, warmup_steps=4, skip_lowering=lowering
  )
  assert _scales(tx, P, [F] * 6)[0] == [4, 4, 4, 4, 8, 16]
  # Ceiling at max_scale with a non-power-of-two factor: never above it, never inf.
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0),
    init_scale=2.0**125,
    growth_factor=3.0,
    growth_interval=1,
    max_scale=2.0**126,
    skip_lowering=lowering,
  )
  assert _scales(tx, P, [F] * 3)[0] == [2.0**126] * 3
  # consecutive_hysteresis refills the hysteresis on every clean step.
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0),
    init_scale=4.0,
    growth_interval=100,
    hysteresis=2,
    consecutive_hysteresis=True,
    skip_lowering=lowering,
  )
  scales, state = _scales(tx, P, [I, F, I, F, I])
  assert scales == [4] * 5 and int(state.policy_state.hysteresis_left) == 1


def test_rule5_backoff_floor_and_hysteresis(lowering):
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=8.0, growth_interval=2, min_scale=2.0, skip_lowering=lowering
  )
  scales, state = _scales(tx, P, [F, I, F, I, I, I])
  assert scales == [8, 4, 4, 2, 2, 2]  # the tracker reset by the overflow delays growth
  assert int(state.policy_state.growth_tracker) == 0
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=8.0, growth_interval=100, hysteresis=3, skip_lowering=lowering
  )
  scales, state = _scales(tx, P, [I, I, I, I, F, I])
  assert scales == [
    8,
    8,
    4,
    2,
    2,
    1,
  ]  # hysteresis_left floors at 0: every further overflow backs off
  assert int(state.policy_state.hysteresis_left) == 0


def test_rule6_counters_saturate_and_consecutive_skips_resets(lowering):
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=8.0, growth_interval=INT32_MAX, skip_lowering=lowering
  )
  step = _stepper(tx, P)
  state = tx.init(P)
  near = jnp.asarray(INT32_MAX - 1, jnp.int32)
  state = state._replace(
    num_steps=near,
    num_skipped=near,
    consecutive_skips=near,
    policy_state=state.policy_state._replace(growth_tracker=near),
  )
  for _ in range(3):
    _, state = step(F, state)
  assert int(state.num_steps) == INT32_MAX
  # The tracker reached growth_interval = 2**31 - 1 without wrapping: one growth, then 1, 2.
  assert float(state.loss_scale) == 16.0 and int(state.policy_state.growth_tracker) == 2
  assert int(state.consecutive_skips) == 0
  state = state._replace(consecutive_skips=near)
  for _ in range(3):
    _, state = step(I, state)
  assert int(state.num_skipped) == int(state.consecutive_skips) == int(state.num_steps) == INT32_MAX
  _, state = step(F, state)
  assert int(state.consecutive_skips) == 0 and int(state.num_skipped) == INT32_MAX
  assert state.num_steps.dtype == state.num_skipped.dtype == jnp.int32


def test_rule7_no_host_sync_and_no_python_control_flow_on_values(lowering):
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3), skip_lowering=lowering)
  state = tx.init(P)
  # Tracing succeeds with abstract values only (Python control flow on them would raise),
  # and the program holds no callback to the host.
  jaxpr = str(jax.make_jaxpr(lambda g, s: tx.update(g, s, P))(F, state))
  assert "callback" not in jaxpr
  # Steps with device-resident inputs move nothing between host and device.
  step = _stepper(tx, P)
  step(F, state)  # compile (transfers the closed-over params once)
  f, i, s = jax.device_put(F), jax.device_put(I), jax.device_put(state)
  with jax.transfer_guard("disallow"):
    for g in (f, i, f, i):
      _, s = step(g, s)
  assert int(s.num_skipped) == 2 and int(s.num_steps) == 4
