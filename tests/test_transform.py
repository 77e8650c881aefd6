"""The core transformation: an optax one, a skip that keeps the parameters bit for bit,
donation, no host synchronisation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step

import optax_dls

PARAMS = {"w": jnp.array([1.0, -0.0, 3.0]), "b": jnp.array([0.5], jnp.float16)}


def _grads(v):
  return {"w": jnp.array([v, 2.0, -1.0]), "b": jnp.array([v], jnp.float16)}


def test_skip_returns_params_bit_for_bit():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0)
  state = tx.init(PARAMS)
  new, state = jax.jit(lambda g, s, p: apply_step(tx, g, s, p))(_grads(float("inf")), state, PARAMS)
  assert not bool(state.last_step_finite)
  assert np.signbit(np.asarray(new["w"])[1])  # -0.0 stays -0.0 (p + 0 would give +0.0)
  for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(PARAMS)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_dls.dynamic_loss_scale(optax.adam(1e-3), hysteresis=2),
    lambda: optax_dls.static_loss_scale(optax.adam(1e-3), 8.0),
    lambda: optax_dls.no_loss_scale(optax.adam(1e-3)),
  ],
)
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


HOST_PARAMS = {"w": jnp.ones((8, 4)), "b": jnp.zeros((4,), jnp.float16)}
HOST_OPS = re.compile(
  r"callback|infeed|outfeed|\bsend\b|\brecv\b|host_compute|xla_python", re.IGNORECASE
)


def _compiled_text(tx, extra=lambda state: None):
  state = tx.init(HOST_PARAMS)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    extra(state)
    return optax.apply_updates(params, updates), state

  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(HOST_PARAMS, state, HOST_PARAMS)
  return lowered.as_text() + lowered.compile().as_text()


@pytest.mark.parametrize(
  "make",
  [
    lambda **kw: optax_dls.dynamic_loss_scale(optax.adam(1e-3), hysteresis=2, **kw),
    lambda **kw: optax_dls.static_loss_scale(optax.adam(1e-3), 2.0**10, **kw),
    lambda **kw: optax_dls.loss_scaled(optax.adam(1e-3), optax_dls.amax_policy(), **kw),
    lambda **kw: optax_dls.loss_scaled(
      optax.chain(optax_dls.underflow_stats(), optax.adam(1e-3)),
      optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=4),
      **kw,
    ),
  ],
  ids=["dynamic", "static", "amax", "features"],
)
def test_update_has_no_host_communication(make, lowering):
  tx = make(skip_lowering=lowering)
  assert not HOST_OPS.findall(_compiled_text(tx))
  # The same pattern finds a host callback when the step holds one, so the check can fail.
  alert = lambda state: jax.debug.callback(lambda x: None, optax_dls.metrics(state)["skip_count"])
  assert HOST_OPS.search(_compiled_text(tx, alert))


def test_a_loss_scaled_transformation_is_an_optax_one():
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  assert type(tx) is optax.GradientTransformationExtraArgs and len(tx) == 2
  init, update = tx  # unpacks like any optax transformation
  assert init is tx.init and update is tx.update


def test_rebuilt_from_its_leaves_it_is_the_same_transformation():
  """As flax 0.11's ``nnx.Optimizer`` rebuilds its ``tx`` from the leaves."""
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  leaves, treedef = jax.tree.flatten(tx)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert type(rebuilt) is type(tx) and rebuilt == tx
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tx)[0]]
  assert paths == [".init", ".update"]


def test_a_scale_below_the_policys_range_is_checked_exactly_then_kept_in_range(lowering):
  # A scale below 1 in the state of a policy whose range starts at 1 (restored from a
  # transformation with min_scale < 1, or set by reset_scale without tx): the step is
  # checked and unscaled by that scale, exactly, and the policy's range holds after it.
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, skip_lowering=lowering)
  params = {"w": jnp.ones(2), "h": jnp.zeros(2, jnp.float16)}
  state = tx.init(params)._replace(loss_scale=jnp.float32(0.5))
  step = jax.jit(tx.update)
  grads = {"w": jnp.full(2, 0.5), "h": jnp.array([1.0, 2.0], jnp.float16)}
  updates, new = step(grads, state, params)
  assert bool(new.last_step_finite)
  np.testing.assert_array_equal(updates["w"], np.full(2, -1.0))
  assert float(new.loss_scale) == 1.0  # kept within [1, 2**24]
  # 40000 / 0.5 overflows float16 (the leaf's own dtype): skipped, the leaf named.
  grads = {"w": jnp.full(2, 0.5), "h": jnp.array([40000.0, 1.0], jnp.float16)}
  updates, new = step(grads, state, params)
  assert not bool(new.last_step_finite)
  assert optax_dls.nonfinite_leaves(new, params) == {"h": "inf"}
  np.testing.assert_array_equal(updates["w"], np.zeros(2))


@pytest.mark.parametrize("extra", ["plain", "labels", "amax"])
def test_update_and_apply_step_run_under_rank_promotion_raise(lowering, extra):
  # Strict trainers set jax_numpy_rank_promotion="raise": nothing inside may broadcast
  # a lower-rank array implicitly (the record's bit packing once did).
  make = {
    "plain": lambda: optax_dls.dynamic_loss_scale(optax.adam(1e-3), skip_lowering=lowering),
    "labels": lambda: optax_dls.dynamic_loss_scale(
      optax.adam(1e-3), skip_lowering=lowering, labels=lambda p: {"a": "x", "b": "y"}
    ),
    "amax": lambda: optax_dls.loss_scaled(
      optax.adam(1e-3), optax_dls.amax_policy(), skip_lowering=lowering
    ),
  }[extra]
  params = {"a": jnp.ones((3, 4)), "b": jnp.ones(5)}
  with jax.numpy_rank_promotion("raise"):
    tx = make()
    state = tx.init(params)
    bad = {"a": jnp.full((3, 4), jnp.inf), "b": jnp.ones(5)}
    _, state = jax.jit(tx.update)(bad, state, params)
    new, state = jax.jit(lambda g, s, p: apply_step(tx, g, s, p))(params, state, params)
  assert optax_dls.nonfinite_leaves(state, params) == {"a": "inf"}
  assert bool(state.last_step_finite) and int(state.num_skipped) == 1
  np.testing.assert_allclose(new["b"], np.full(5, 1.0 - 1e-3), rtol=1e-5)  # Adam's first step
