"""Failure kinds reported against other loss scalers (listed in docs/design.md), each
impossible here."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import enable_x64
from jax import lax

import optax_dls

P = {"w": jnp.zeros(3, jnp.float32)}
FINITE = {"w": jnp.ones(3, jnp.float32)}
BAD = {"w": jnp.array([1.0, jnp.inf, 1.0], jnp.float32)}


def _train(tx, grads_seq, params=P):
  """Runs a jitted step (compiled once) over grads_seq; grads are multiplied by S as a
  scaled loss would make them. Returns params, state and the scale after every step."""

  @jax.jit
  def step(params, state, g):
    g = jax.tree.map(lambda x: x * optax_dls.find_state(state).loss_scale.astype(x.dtype), g)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state, scales = tx.init(params), []
  for g in grads_seq:
    params, state = step(params, state, g)
    scales.append(float(state.loss_scale))
  return params, state, scales


def test_1_scale_never_grows_to_inf(lowering):
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1e-3),
    init_scale=2.0**120,
    growth_interval=1,
    max_scale=2.0**126,
    skip_lowering=lowering,
  )
  _, _, scales = _train(tx, [FINITE] * 20)
  assert all(np.isfinite(scales)) and max(scales) == 2.0**126
  assert scales[:6] == [2.0**121, 2.0**122, 2.0**123, 2.0**124, 2.0**125, 2.0**126]


def test_2_scale_never_backs_off_to_zero(lowering):
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3), init_scale=2.0**16, skip_lowering=lowering)
  params, state, scales = _train(tx, [BAD] * 200 + [FINITE])
  assert min(scales) == 1.0 and scales[16:200] == [1.0] * 184
  assert bool(jnp.all(jnp.isfinite(params["w"])))
  assert bool(jnp.all(params["w"] < 0))  # the finite step after them was applied
  assert int(state.num_skipped) == 200


def test_3_unscale_uses_the_scale_of_this_loss_on_a_growth_step(lowering):
  x = jnp.array([0.3, -1.7, 2.5e-3], jnp.float32)
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=2.0**8, growth_interval=1, skip_lowering=lowering
  )
  bare = optax.sgd(1.0)
  state, bstate, w = tx.init(P), bare.init(P), P

  @jax.jit
  def step(w, state, bstate):
    g = jax.grad(lambda p: optax_dls.scale_loss(jnp.dot(p["w"], x), state))(w)
    updates, state = tx.update(g, state, w)
    bupdates, bstate = bare.update(jax.grad(lambda p: jnp.dot(p["w"], x))(w), bstate, w)
    return updates, bupdates, state, bstate

  for i in range(3):  # every step is a growth step
    updates, bupdates, state, bstate = step(w, state, bstate)
    assert float(state.loss_scale) == 2.0 ** (9 + i)
    np.testing.assert_array_equal(updates["w"], bupdates["w"])
    np.testing.assert_array_equal(updates["w"], -x)


def test_5_skipped_step_does_not_advance_count_or_schedule(lowering):
  sched = lambda t: t + 1.0  # lr(t) = t + 1
  g = jnp.array([0.5, -2.0, 1.0], jnp.float32)
  tx = optax_dls.dynamic_loss_scale(
    optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(sched)),
    init_scale=4.0,
    skip_lowering=lowering,
  )
  tx2 = optax_dls.dynamic_loss_scale(optax.sgd(sched), init_scale=4.0, skip_lowering=lowering)
  for t in (tx, tx2):
    state = t.init(P)
    step = jax.jit(lambda g, s, t=t: t.update(g, s, P))
    updates, state = step({"w": jnp.array([jnp.inf, 1.0, 1.0])}, state)
    assert float(jnp.abs(updates["w"]).sum()) == 0.0
    updates, state = step({"w": g * 2.0}, state)  # S is 2 after the overflow
    counts = [int(c) for c in jax.tree.leaves(state.inner_state) if c.dtype == jnp.int32]
    assert counts and all(c == 1 for c in counts), counts
    if t is tx2:
      np.testing.assert_array_equal(updates["w"], -1.0 * g)  # lr(0) = 1, not lr(1) = 2


def _same(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("round_trip", ["flatten", "jit", "scan"])
def test_7_round_trip_keeps_every_field_and_the_next_step(round_trip, lowering):
  tx = optax_dls.dynamic_loss_scale(
    optax.adam(1e-3), init_scale=512.0, growth_interval=2, skip_lowering=lowering
  )
  step = jax.jit(lambda g, s: tx.update(jax.tree.map(lambda x: x * s.loss_scale, g), s, P)[1])
  saved = step(FINITE, step(FINITE, tx.init(P)))  # S: 512 -> 1024 (growth), tracker 0
  saved = step(FINITE, saved)  # tracker 1
  assert float(saved.loss_scale) == 1024.0 and int(saved.policy_state.growth_tracker) == 1
  if round_trip == "flatten":
    leaves, treedef = jax.tree.flatten(saved)
    restored = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  elif round_trip == "jit":
    restored = jax.jit(lambda s: s)(saved)
  else:
    restored = lax.scan(lambda c, _: (c, None), saved, None, length=3)[0]
  _same(restored, saved)
  after = step(FINITE, restored)
  assert float(after.loss_scale) == 2048.0 and int(after.policy_state.growth_tracker) == 0
  _same(after, step(FINITE, saved))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_8_nonfinite_detected_in_every_float_dtype(dtype, lowering):
  with enable_x64(dtype == "float64"):
    tx = optax_dls.static_loss_scale(optax.identity(), 2.0, skip_lowering=lowering)

    @jax.jit
    def step(bad):
      grads = {
        "ok": jnp.ones(2, jnp.float32),
        "x": jnp.array([1.0, 1.0, 2.0], dtype).at[1].set(bad),
      }
      updates, state = tx.update(grads, tx.init(grads))
      return optax_dls.all_finite(grads), state.last_step_finite, updates["x"]

    for bad in (np.inf, -np.inf, np.nan, 3.0):
      finite, applied, ux = step(jnp.asarray(bad, dtype))
      assert bool(finite) == bool(applied) == np.isfinite(bad), bad
      assert ux.dtype == jnp.dtype(dtype)
      assert bool(jnp.any(ux != 0)) == np.isfinite(bad)


@pytest.mark.parametrize(
  "consecutive,seq,expected",
  [
    (False, "IFI", [2**16, 2**16, 2**15]),
    (True, "IFI", [2**16, 2**16, 2**16]),
    (False, "III", [2**16, 2**15, 2**14]),
  ],
)
def test_9_hysteresis_sequences(consecutive, seq, expected, lowering):
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0),
    init_scale=2.0**16,
    growth_interval=10_000,
    hysteresis=2,
    consecutive_hysteresis=consecutive,
    skip_lowering=lowering,
  )
  _, _, scales = _train(tx, [BAD if c == "I" else FINITE for c in seq])
  assert scales == expected
