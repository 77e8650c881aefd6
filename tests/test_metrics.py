"""metrics(): the scalar dict, the new state fields, and opt-in gradient-underflow statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {"base": {"w": jnp.zeros((4, 3), jnp.float32)}, "lora": {"a": jnp.zeros((5,), jnp.float32)}}
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


def _step(tx, grads, scale=1024.0):
  state = tx.init(PARAMS)
  state = optax_dls.reset_scale(state, scale)
  scaled = jax.tree.map(lambda g: jnp.asarray(g) * scale, grads)
  _, state = jax.jit(tx.update)(scaled, state, PARAMS)
  return state


def test_metrics_core_keys_follow_the_steps():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, alerts=False)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  good = jax.tree.map(jnp.ones_like, PARAMS)
  bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.inf), PARAMS)
  for g in (good, bad, bad, good, bad):
    _, state = update(jax.tree.map(lambda x: x * optax_dls.loss_scale(state), g), state, PARAMS)
  m = jax.device_get(optax_dls.metrics(state))
  assert m["skip_count"] == 3 and m["num_steps"] == 5 and bool(m["skipped"])
  assert m["consecutive_skips"] == 1
  assert m["update_ratio"] == pytest.approx(2 / 5)
  assert m["loss_scale"] == 8.0 / 2**3
  assert not m["fp32_fallback"]
  assert not any(k.startswith("underflow/") for k in m)


def test_underflow_stats_overall_match_numpy():
  grads = _grads(np.random.default_rng(0))
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), underflow_stats=True, alerts=False)
  m = optax_dls.metrics(_step(tx, grads))
  zero, sub = _oracle(grads["base"]["w"], grads["lora"]["a"])
  assert float(m["underflow/zero_frac"]) == pytest.approx(zero)
  assert float(m["underflow/subnormal_frac"]) == pytest.approx(sub)
  assert sorted(k for k in m if k.startswith("underflow/")) == ["underflow/subnormal_frac", "underflow/zero_frac"]


@pytest.mark.parametrize("labels", [LABELS, lambda g: jax.tree.map(lambda _: "x", g) | {"lora": {"a": "lora"}}],
                         ids=["pytree", "callable"])
def test_underflow_stats_per_label_match_numpy(labels):
  grads = _grads(np.random.default_rng(1))
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), underflow_stats=labels, alerts=False)
  state = _step(tx, grads)
  m = jax.device_get(optax_dls.metrics(state))
  zero, sub = _oracle(grads["lora"]["a"])
  assert m["underflow/lora/zero_frac"] == pytest.approx(zero)
  assert m["underflow/lora/subnormal_frac"] == pytest.approx(sub)
  other = "base" if isinstance(labels, dict) else "x"
  zero, sub = _oracle(grads["base"]["w"])
  assert m[f"underflow/{other}/zero_frac"] == pytest.approx(zero)
  assert m[f"underflow/{other}/subnormal_frac"] == pytest.approx(sub)


def test_underflow_state_before_first_step_and_dtypes():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), underflow_stats=LABELS, alerts=False)
  state = tx.init(PARAMS)
  leaves = jax.tree.leaves(state.underflow)
  assert len(leaves) == 6 and all(x.dtype == jnp.float32 and x.shape == () for x in leaves)
  assert all(np.isnan(x) for x in leaves)
  off = optax_dls.dynamic_loss_scale(optax.sgd(0.1), alerts=False).init(PARAMS)
  assert off.underflow == {}


def test_new_state_fields_have_fixed_dtypes_and_round_trip():
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3), fallback_after=2, alerts=False)
  state = tx.init(PARAMS)
  assert state.skips_at_min_scale.dtype == jnp.int32
  assert state.fp32_fallback.dtype == jnp.bool_
  assert state.fallback_steps_left.dtype == jnp.int32
  g = jax.tree.map(lambda x: x + jnp.inf, PARAMS)
  _, new = jax.jit(tx.update)(g, state, PARAMS)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
    assert a.dtype == b.dtype and a.shape == b.shape
  back = jax.tree.unflatten(jax.tree.structure(new), jax.tree.leaves(new))
  assert back._fields == new._fields


def test_new_field_names_are_unambiguous_in_an_optax_chain():
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax_dls.dynamic_loss_scale(optax.adam(1e-3), alerts=False))
  state = tx.init(PARAMS)
  for name in ("fp32_fallback", "fallback_steps_left", "skips_at_min_scale", "underflow"):
    optax.tree_utils.tree_get(state, name)  # raises KeyError if absent or ambiguous


@pytest.mark.parametrize("bad, error", [({"base": {"w": 3}, "lora": {"a": "lora"}}, TypeError),
                                        ({"base": {"w": "a/b"}, "lora": {"a": "x"}}, ValueError),
                                        ({"base": {"w": "zero_frac"}, "lora": {"a": "x"}}, ValueError)])
def test_bad_labels_raise_naming_the_label(bad, error):
  with pytest.raises(error, match="label"):
    optax_dls.dynamic_loss_scale(optax.sgd(0.1), underflow_stats=bad)
