"""underflow_stats: fractions of zero and float16-subnormal gradient entries, chained inside."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {
  "base": {"w": jnp.zeros((4, 3), jnp.float32)},
  "lora": {"a": jnp.zeros((5,), jnp.float32)},
}
LABELS = {"base": {"w": "base"}, "lora": {"a": "lora"}}


def _grads(rng):
  """Unscaled gradients with exact zeros, fp16-subnormal and normal entries."""
  mags = np.array([0.0, 1e-7, 3e-5, 1e-3, 0.5], np.float32)
  w = rng.choice(mags, size=(4, 3)) * rng.choice([-1, 1], size=(4, 3))
  a = rng.choice(mags, size=(5,))
  return {"base": {"w": w.astype(np.float32)}, "lora": {"a": a.astype(np.float32)}}


def _oracle(*arrays):
  x = np.abs(np.concatenate([np.ravel(a) for a in arrays]))
  return (x == 0).mean(), ((x > 0) & (x < 2.0**-14)).mean()


def _tx(labels=None, lowering="auto"):
  return optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.underflow_stats(labels), optax.sgd(0.1)), skip_lowering=lowering
  )


def _step(tx, grads, scale=1024.0, state=None):
  state = optax_dls.reset_scale(tx.init(PARAMS) if state is None else state, scale)
  scaled = jax.tree.map(lambda g: jnp.asarray(g) * scale, grads)
  _, state = jax.jit(tx.update)(scaled, state, PARAMS)
  return state


def test_underflow_stats_overall_match_numpy(lowering):
  grads = _grads(np.random.default_rng(0))
  m = optax_dls.metrics(_step(_tx(lowering=lowering), grads))
  zero, sub = _oracle(grads["base"]["w"], grads["lora"]["a"])
  assert float(m["underflow/zero_frac"]) == pytest.approx(zero)
  assert float(m["underflow/subnormal_frac"]) == pytest.approx(sub)
  assert sorted(k for k in m if k.startswith("underflow/")) == [
    "underflow/subnormal_frac",
    "underflow/zero_frac",
  ]


@pytest.mark.parametrize(
  "labels",
  [LABELS, lambda g: jax.tree.map(lambda _: "x", g) | {"lora": {"a": "lora"}}],
  ids=["pytree", "callable"],
)
def test_underflow_stats_per_label_match_numpy(labels):
  grads = _grads(np.random.default_rng(1))
  m = jax.device_get(optax_dls.metrics(_step(_tx(labels), grads)))
  zero, sub = _oracle(grads["lora"]["a"])
  assert m["underflow/lora/zero_frac"] == pytest.approx(zero)
  assert m["underflow/lora/subnormal_frac"] == pytest.approx(sub)
  other = "base" if isinstance(labels, dict) else "x"
  zero, sub = _oracle(grads["base"]["w"])
  assert m[f"underflow/{other}/zero_frac"] == pytest.approx(zero)
  assert m[f"underflow/{other}/subnormal_frac"] == pytest.approx(sub)


def test_a_skipped_step_keeps_the_last_applied_fractions(lowering):
  grads = _grads(np.random.default_rng(2))
  tx = _tx(lowering=lowering)
  state = _step(tx, grads)
  before = jax.device_get(optax_dls.metrics(state))
  bad = jax.tree.map(lambda g: jnp.asarray(g).at[0].set(np.inf) if g.ndim == 1 else g, grads)
  after = jax.device_get(optax_dls.metrics(_step(tx, bad, state=state)))
  assert after["skipped"] and after["underflow/zero_frac"] == before["underflow/zero_frac"]


def test_underflow_state_before_first_step_and_dtypes():
  state = _tx(LABELS).init(PARAMS)
  stats = optax_dls.find_state(state).inner_state[0]
  leaves = jax.tree.leaves(stats)
  assert len(leaves) == 6 and all(x.dtype == jnp.float32 and x.shape == () for x in leaves)
  assert all(np.isnan(x) for x in leaves)
  assert not any(
    k.startswith("underflow/")
    for k in optax_dls.metrics(optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS))
  )


def test_works_with_no_loss_scale_and_python_float_parameters():
  tx = optax_dls.no_loss_scale(optax.chain(optax_dls.underflow_stats(), optax.sgd(0.1)))
  params = {"w": 1.0, "v": jnp.ones(3)}
  state = tx.init(params)
  _, state = tx.update({"w": 0.0, "v": jnp.array([1e-6, 1.0, 2.0])}, state, params)
  m = optax_dls.metrics(state)
  assert float(m["underflow/zero_frac"]) == 0.25 and float(m["underflow/subnormal_frac"]) == 0.25


def test_counts_are_summed_over_axis_name_under_shard_map():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  P = jax.sharding.PartitionSpec
  tx = optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.underflow_stats(axis_name="d"), optax.sgd(0.1)),
    init_scale=1.0,
    axis_name="d",
  )
  params = {"w": jnp.zeros(8)}
  state = tx.init(params)
  spec = jax.tree.map(lambda _: P(), state)

  def local(g, s):
    _, s = tx.update({"w": g}, s, None)
    return s

  g = jnp.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1e-6])
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), spec), out_specs=spec))(g, state)
  m = optax_dls.metrics(out)
  assert float(m["underflow/zero_frac"]) == 3 / 8 and float(m["underflow/subnormal_frac"]) == 1 / 8


@pytest.mark.parametrize(
  "bad, error",
  [
    ({"base": {"w": 3}, "lora": {"a": "lora"}}, TypeError),
    ({"base": {"w": "a/b"}, "lora": {"a": "x"}}, ValueError),
    ({"base": {"w": "zero_frac"}, "lora": {"a": "x"}}, ValueError),
    ({}, ValueError),
  ],
)
def test_bad_labels_raise_naming_the_label(bad, error):
  with pytest.raises(error, match="label"):
    optax_dls.underflow_stats(bad)
