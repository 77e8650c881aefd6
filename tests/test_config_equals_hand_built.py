"""from_config builds what the same arguments build by hand, key by key.

Each case below sets one configuration key (or the pair a key needs) and builds the
transformation by hand with the same arguments; both run the same steps (a finite one, an
overflow, finite ones) and must give the same updates, states and metrics bit for bit.
The cases cover every key from_config accepts: a new key needs a case here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls
from optax_dls import _policies
from optax_dls import config as _config

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0, 4.0], jnp.float32), "b": jnp.array([0.25], jnp.float32)}
D = optax_dls.dynamic_policy
NOOP = _policies.noop_policy

# (the loss_scale section, the policy it means, loss_scaled keyword arguments, underflow_stats)
CASES = {
  "kind=dynamic": ({"kind": "dynamic"}, D(), {}, False),
  "init_scale": ({"init_scale": 512}, D(init_scale=512), {}, False),
  "growth_factor": ({"growth_factor": 4.0}, D(growth_factor=4.0), {}, False),
  "backoff_factor": ({"backoff_factor": 0.25}, D(backoff_factor=0.25), {}, False),
  "growth_interval": ({"growth_interval": 2}, D(growth_interval=2), {}, False),
  "min_scale": ({"min_scale": 2.0**14}, D(min_scale=2.0**14), {}, False),
  "max_scale": ({"max_scale": 2.0**15}, D(max_scale=2.0**15), {}, False),
  "hysteresis": ({"hysteresis": 2}, D(hysteresis=2), {}, False),
  "consecutive_hysteresis": (
    {"hysteresis": 2, "consecutive_hysteresis": True},
    D(hysteresis=2, consecutive_hysteresis=True),
    {},
    False,
  ),
  "warmup_steps": (
    {"warmup_steps": 3, "growth_interval": 1},
    D(warmup_steps=3, growth_interval=1),
    {},
    False,
  ),
  "preset": (
    {"preset": "text_llm"},
    D(init_scale=2.0**16, growth_interval=1000, hysteresis=2),
    {},
    False,
  ),
  "preset=torch, its own argument names": (
    {"preset": "torch", "growth_interval": 2},
    _config.preset("torch", growth_interval=2),
    {},
    False,
  ),
  "kind=static, scale": (
    {"kind": "static", "scale": 1024},
    _policies.static_policy(1024),
    {},
    False,
  ),
  "kind=none": ({"kind": "none"}, NOOP(), {}, False),
  "fallback_after, fallback_steps, fallback_scale": (
    {"fallback_after": 1, "fallback_steps": 2, "fallback_scale": 4.0},
    optax_dls.fp32_fallback(D(), after=1, steps=2, scale=4.0),
    {},
    False,
  ),
  "skip_lowering": ({"skip_lowering": "where"}, D(), {"skip_lowering": "where"}, False),
  "underflow_stats": ({"underflow_stats": True}, D(), {}, True),
}


def _hand_built(policy, kwargs, stats, inner, axis_name=None):
  if stats:
    inner = optax.chain(optax_dls.underflow_stats(axis_name=axis_name), inner)
  return optax_dls.loss_scaled(inner, policy, axis_name=axis_name, **kwargs)


def _steps():
  """Scaled gradients: finite, an overflow, a NaN, then finite ones with some zeros."""
  g = lambda w, b: {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray([b], jnp.float32)}
  return [
    g([1.0, 2.0, 3.0, 4.0], 1.0),
    g([1.0, jnp.inf, 3.0, 4.0], 1.0),
    g([1.0, 2.0, 3.0, 4.0], jnp.nan),
    g([0.0, 2.0, 0.0, 4.0], 1e-8),
    g([1.0, 0.0, 3.0, 4.0], 2.0),
    g([1.0, 2.0, 3.0, 4.0], 1.0),
  ]


def _run(tx):
  update = jax.jit(tx.update)
  state, out = tx.init(PARAMS), []
  for grads in _steps():
    updates, state = update(grads, state, PARAMS)
    out.append((updates, optax_dls.metrics(state)))
  return state, out


def _same(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


def test_every_key_from_config_accepts_has_a_case():
  covered = set().union(*(set(section) for section, *_ in CASES.values()))
  assert covered | {"axis_name"} == set(_config._ALL_KEYS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_configured_transformation_equals_the_hand_built_one(name):
  section, policy, kwargs, stats = CASES[name]
  inner = optax.adam(0.1)
  configured = _config.from_config({"loss_scale": dict(section)}, inner)
  by_hand = _hand_built(policy, kwargs, stats, inner)
  _same(_run(configured), _run(by_hand))


def test_axis_name_with_underflow_stats_equals_the_hand_built_one_under_pmap():
  """The configured underflow counts are summed over the axis, as by hand: every device
  holds the fractions of all devices' gradients."""
  n = 4
  section = {"axis_name": "batch", "underflow_stats": True}
  inner = optax.sgd(0.1)
  configured = _config.from_config({"loss_scale": section}, inner)
  by_hand = _hand_built(D(), {}, True, inner, axis_name="batch")
  # Device i's gradients hold i zeros among 4 entries: the fractions differ by device.
  w = jnp.array([[0.0 if j < i else 1.0 for j in range(4)] for i in range(n)], jnp.float32)
  grads = {"w": w, "b": jnp.ones((n, 1), jnp.float32)}
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), PARAMS)

  def step(tx):
    def one(g, p):
      return tx.update(g, tx.init(p), p)

    _, state = jax.pmap(one, axis_name="batch")(grads, params)
    return optax_dls.metrics(jax.tree.map(lambda x: x[0], state)), state

  (m_conf, s_conf), (_, s_hand) = step(configured), step(by_hand)
  _same(s_conf, s_hand)
  assert float(m_conf["underflow/zero_frac"]) == pytest.approx(6 / 20)  # (0+1+2+3) of 4*5


def test_axis_name_with_underflow_stats_compiles_under_shard_map():
  mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  configured = _config.from_config(
    {"loss_scale": {"axis_name": "batch", "underflow_stats": True}}, optax.sgd(0.1)
  )

  def one(g, p):
    updates, state = configured.update(g, configured.init(p), p)
    return updates, optax_dls.metrics(state)["underflow/zero_frac"][None]

  rows = NamedSharding(mesh, P("batch"))
  grads = jax.device_put({"w": jnp.arange(16.0).reshape(4, 4), "b": jnp.ones((4, 1))}, rows)
  params = jax.device_put({"w": jnp.ones((4, 4)), "b": jnp.ones((4, 1))}, rows)
  f = jax.jit(
    jax.shard_map(one, mesh=mesh, in_specs=P("batch"), out_specs=(P("batch"), P("batch")))
  )
  _, zero_frac = f(grads, params)
  np.testing.assert_array_equal(np.asarray(zero_frac), np.full(4, 1 / 20, np.float32))
