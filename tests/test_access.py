"""Finding and reading the loss-scale state inside any optimizer state; all_finite."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls import LossScaleState
from optax_dls._policies import DynamicScaleState

P = {"w": jnp.ones(3, jnp.float32)}
DLS = dict(init_scale=2.0**8, growth_interval=3)

OWN_FIELDS = [f for f in LossScaleState._fields if f not in ("policy_state", "inner_state")] + list(
  DynamicScaleState._fields
)


def _holders():
  """(name, optimizer, wrap) where wrap puts the optimizer state where a user might keep it."""
  dls = optax_dls.dynamic_loss_scale
  return [
    (
      "chain",
      optax.chain(dls(optax.adam(1e-3), **DLS), optax.clip_by_global_norm(1e3)),
      lambda s: s,
    ),
    ("multisteps", dls(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2), **DLS), lambda s: s),
    ("dict", dls(optax.adam(1e-3), **DLS), lambda s: {"opt": s, "step": jnp.zeros([], jnp.int32)}),
  ]


@pytest.mark.parametrize("holder", range(3), ids=["chain", "multisteps", "dict"])
def test_access_finds_state_and_reads_it(holder):
  _, tx, wrap = _holders()[holder]
  step = jax.jit(lambda g, s: tx.update(g, s, P))
  state = tx.init(P)
  for g in (1.0, 2.0, jnp.inf, 3.0):
    _, state = step(
      {"w": jnp.full(3, g, jnp.float32) * optax_dls.find_state(state).loss_scale}, state
    )
  held = wrap(state)
  ours = optax_dls.find_state(held)
  assert isinstance(ours, LossScaleState)
  assert float(optax_dls.find_state(held).loss_scale) == 2.0**7  # one backoff, tracker 1 after it
  loss = optax_dls.scale_loss(jnp.float16(1.5), held)
  assert loss.dtype == jnp.float32 and float(loss) == 1.5 * 2.0**7
  m = optax_dls.metrics(held)
  assert {
    "loss_scale",
    "skipped",
    "skip_count",
    "consecutive_skips",
    "num_steps",
    "update_ratio",
    "grad_norm",
  } <= set(m)
  assert all(isinstance(v, jax.Array) for v in m.values())  # no host transfer
  # One bit per gradient leaf in a few words; every other key is a scalar.
  assert m["nonfinite_leaves"].shape == m["nonfinite_nan"].shape == (1,)
  assert all(v.shape == () for k, v in m.items() if k not in ("nonfinite_leaves", "nonfinite_nan"))
  assert float(m["loss_scale"]) == 2.0**7 and not bool(m["skipped"])
  assert int(m["skip_count"]) == 1 and int(m["consecutive_skips"]) == 0 and int(m["num_steps"]) == 4
  assert float(m["update_ratio"]) == 0.75
  np.testing.assert_allclose(float(m["grad_norm"]), 3.0 * np.sqrt(3.0), rtol=1e-6)

  reset = optax_dls.reset_scale(held, 2.0**12)
  assert jax.tree.structure(reset) == jax.tree.structure(held)
  r = optax_dls.find_state(reset)
  assert r.loss_scale.dtype == jnp.float32 and float(r.loss_scale) == 2.0**12
  assert int(r.policy_state.growth_tracker) == 0 and int(ours.policy_state.growth_tracker) == 1
  for f in ("num_steps", "num_skipped", "consecutive_skips", "grad_norm", "inner_state"):
    for a, b in zip(jax.tree.leaves(getattr(r, f)), jax.tree.leaves(getattr(ours, f))):
      np.testing.assert_array_equal(a, b)
  # A traced value is allowed (e.g. inside a jitted training step).
  traced = jax.jit(optax_dls.reset_scale)(held, jnp.float32(4.0))
  assert float(optax_dls.find_state(traced).loss_scale) == 4.0


def test_reset_scale_then_grows_after_a_full_interval():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), **DLS)
  step = jax.jit(lambda g, s: tx.update(g, s, P)[1])
  state = step(P, step(P, tx.init(P)))  # tracker 2 of 3
  state = optax_dls.reset_scale(state, 16.0)
  scales = []
  for _ in range(3):
    state = step(P, state)
    scales.append(float(state.loss_scale))
  assert scales == [16.0, 16.0, 32.0]


def test_none_or_several_states_raise_clear_errors():
  adam_state = optax.adam(1e-3).init(P)
  for fn in (optax_dls.find_state, optax_dls.metrics):
    with pytest.raises(ValueError, match="no LossScaleState"):
      fn(adam_state)
  with pytest.raises(ValueError, match="no LossScaleState"):
    optax_dls.scale_loss(jnp.float32(1.0), {"a": adam_state})
  two = optax.chain(
    optax_dls.dynamic_loss_scale(optax.adam(1e-3)), optax_dls.static_loss_scale(optax.sgd(1.0), 4.0)
  ).init(P)
  for fn in (
    optax_dls.find_state,
    optax_dls.metrics,
    lambda s: optax_dls.reset_scale(s, 2.0),
    lambda s: optax_dls.scale_loss(1.0, s),
  ):
    with pytest.raises(ValueError, match="2 LossScaleStates.*ambiguous"):
      fn(two)
  inner = optax_dls.dynamic_loss_scale(optax.adam(1e-3)).init(P)
  nested = inner._replace(inner_state=inner)  # loss scaling twice (which init refuses)
  with pytest.raises(ValueError, match="ambiguous"):
    optax_dls.find_state(nested)


def test_multisteps_outside_the_loss_scaler_is_refused_with_advice():
  # MultiSteps(dynamic_loss_scale(...)) would accumulate a NaN micro-batch before the
  # check; the supported order is dynamic_loss_scale(MultiSteps(...)), found above.
  state = optax.MultiSteps(optax_dls.dynamic_loss_scale(optax.adam(1e-3)), 2).init(P)
  with pytest.raises(ValueError, match="MultiSteps"):
    optax_dls.find_state(state)


def test_scale_loss_rejects_integer_loss():
  state = optax_dls.dynamic_loss_scale(optax.sgd(1.0)).init(P)
  with pytest.raises(TypeError, match="loss"):
    optax_dls.scale_loss(jnp.int32(3), state)


@pytest.mark.parametrize("chained", [False, True])
def test_tree_get_finds_each_field_unambiguously(chained):
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3), init_scale=2.0**9, hysteresis=3)
  if chained:
    tx = optax.chain(tx, optax.add_decayed_weights(1e-4), optax.scale_by_adam())
  state = tx.init(P)
  ours = optax_dls.find_state(state)
  for f in OWN_FIELDS:
    expected = getattr(ours.policy_state if f in DynamicScaleState._fields else ours, f)
    got = optax.tree_utils.tree_get(state, f)  # raises if the key is ambiguous
    assert jax.tree.structure(got) == jax.tree.structure(expected), f
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
      np.testing.assert_array_equal(a, b)
  assert float(optax.tree_utils.tree_get(state, "loss_scale")) == 2.0**9
  assert int(optax.tree_utils.tree_get(state, "hysteresis_left")) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_all_finite_is_exact(dtype):
  big = {"f32": 1e38, "float16": 65504.0, "bfloat16": 3e38, "float32": 3.4e38}[dtype]
  f = jax.jit(optax_dls.all_finite)
  ok = {
    "x": jnp.array([big, -big, 0.0, 1e-8], dtype),
    "big32": jnp.array([1e38], jnp.float32),
    "i": jnp.array([2**31 - 1], jnp.int32),
    "n": None,
  }
  assert bool(f(ok))
  for bad in (np.inf, -np.inf, np.nan):
    assert not bool(f(dict(ok, x=ok["x"].at[2].set(bad)))), bad
  assert bool(optax_dls.all_finite({})) and bool(optax_dls.all_finite([]))
  assert bool(optax_dls.all_finite({"i": jnp.arange(3), "b": jnp.array([True]), "n": None}))
  assert bool(optax_dls.all_finite({"empty": jnp.zeros((0, 3), dtype)}))


def test_metrics_core_keys_follow_the_steps():
  params = {"w": jnp.zeros((4, 3), jnp.float32)}
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  state = tx.init(params)
  update = jax.jit(tx.update)
  good = jax.tree.map(jnp.ones_like, params)
  bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.inf), params)
  for g in (good, bad, bad, good, bad):
    scale = optax_dls.find_state(state).loss_scale
    _, state = update(jax.tree.map(lambda x, s=scale: x * s, g), state, params)
  m = jax.device_get(optax_dls.metrics(state))
  assert m["skip_count"] == 3 and m["num_steps"] == 5 and bool(m["skipped"])
  assert m["consecutive_skips"] == 1
  assert m["update_ratio"] == pytest.approx(2 / 5)
  assert m["loss_scale"] == 8.0 / 2**3
  assert not m["nonfinite_loss"] and m["nonfinite_step"] == 5  # the last skip's record
  # The core's keys only: a feature not in use (the float32 fallback, recomputation)
  # reports nothing.
  assert sorted(m) == [
    "consecutive_skips",
    "grad_norm",
    "loss_scale",
    "nonfinite_leaves",
    "nonfinite_loss",
    "nonfinite_nan",
    "nonfinite_step",
    "num_steps",
    "skip_count",
    "skipped",
    "update_ratio",
  ]


ATTN = "decoder/layers_3/attn"
NESTED = {
  "decoder": {
    "layers_3": {
      "attn": {"query": {"kernel": jnp.ones((2, 2))}, "value": {"kernel": jnp.ones((2, 2))}},
      "mlp": {"bias": jnp.ones(2, jnp.float16)},
    }
  },
  "embed": jnp.ones(3),
}


def _grads_with(bad):
  """Gradients of ones for NESTED; ``bad``: {leaf name: values of its first entries}."""

  def leaf(path, x):
    g = np.ones(x.shape, x.dtype)
    values = bad.get("/".join(k.key for k in path), [])
    g.reshape(-1)[: len(values)] = values
    return jnp.asarray(g)

  return jax.tree_util.tree_map_with_path(leaf, NESTED)


# Steps in a row: (bad gradient entries, loss, the leaves named, whether the loss is named).
NAMED_STEPS = [
  ({f"{ATTN}/query/kernel": [np.inf]}, 1.0, {f"{ATTN}/query/kernel": "inf"}, False),
  (
    {
      f"{ATTN}/query/kernel": [1.0, -np.inf],
      f"{ATTN}/value/kernel": [np.nan],
      "decoder/layers_3/mlp/bias": [np.inf, np.nan],  # both: a NaN
    },
    1.0,
    {
      f"{ATTN}/query/kernel": "inf",
      f"{ATTN}/value/kernel": "nan",
      "decoder/layers_3/mlp/bias": "nan",
    },
    False,
  ),
  ({}, np.nan, {}, True),  # finite gradients, a loss that is not finite
  ({}, np.inf, {}, True),
]


def test_nonfinite_leaves_names_nested_leaves_and_a_bad_loss_alone_names_none(lowering):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), skip_lowering=lowering)
  update = jax.jit(lambda g, s, loss: tx.update(g, s, NESTED, loss=loss)[1])
  state = tx.init(NESTED)
  for i, (bad, loss, names, loss_named) in enumerate(NAMED_STEPS, start=1):
    state = update(_grads_with(bad), state, jnp.float32(loss))
    m = optax_dls.metrics(state)
    assert bool(m["skipped"]) and int(m["nonfinite_step"]) == i, i
    assert optax_dls.nonfinite_leaves(state, NESTED) == names, i
    assert bool(m["nonfinite_loss"]) == loss_named, i
  # A finite step keeps the record of the last non-finite one.
  state = update(_grads_with({}), state, jnp.float32(1.0))
  m = optax_dls.metrics(state)
  assert not bool(m["skipped"]) and int(m["nonfinite_step"]) == 4 and bool(m["nonfinite_loss"])


def test_feature_states_report_their_keys_and_are_unambiguous_in_a_chain():
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=2)
  inner = optax.chain(optax_dls.underflow_stats(), optax.adam(1e-3))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax_dls.loss_scaled(inner, policy))
  state = tx.init(P)
  m = optax_dls.metrics(state)
  assert {
    "fp32_fallback",
    "skips_at_min_scale",
    "underflow/zero_frac",
    "underflow/subnormal_frac",
  } <= set(m)
  for name in (
    "fp32_fallback",
    "steps_left",
    "skips_at_min_scale",
    "fractions",
    "min_scale",
    "max_scale",
  ):
    optax.tree_utils.tree_get(state, name)  # raises KeyError if absent or ambiguous
  g = {"w": jnp.full(3, jnp.inf)}
  _, new = jax.jit(tx.update)(g, state, P)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
    assert a.dtype == b.dtype and a.shape == b.shape


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0, 2.0**127])
def test_reset_scale_refuses_a_static_value_that_is_not_a_valid_scale(bad):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), max_scale=2.0**16)
  with pytest.raises(ValueError, match="value"):
    optax_dls.reset_scale(tx.init(P), bad)


def test_reset_scale_checks_a_valid_scale_and_the_next_update_keeps_the_range():
  """The state holds no range: any valid scale is taken, the step after it unscales by
  it, and that update leaves the scale within the transformation's range."""
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), max_scale=2.0**16)
  state = optax_dls.reset_scale(tx.init(P), 2.0**20)
  assert float(state.loss_scale) == 2.0**20
  updates, state = tx.update({"w": jnp.full(3, 2.0**20)}, state)
  np.testing.assert_array_equal(updates["w"], -np.ones(3, np.float32))  # unscaled by 2**20
  assert float(state.loss_scale) == 2.0**16
  for bad in (math.nan, math.inf, 0.0, -1.0, 2.0**127):
    with pytest.raises(ValueError, match="value"):
      optax_dls.reset_scale(state, bad)


def test_a_traced_reset_restarts_growth_and_the_next_update_keeps_the_range():
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=4.0, growth_interval=3, max_scale=2.0**16
  )
  state = tx.init(P)
  _, state = tx.update({"w": jnp.ones(3)}, state)
  assert int(state.policy_state.growth_tracker) == 1
  reset = jax.jit(optax_dls.reset_scale)
  for value, kept in ((2.0**30, 2.0**16), (0.25, 1.0)):
    new = reset(state, jnp.float32(value))
    assert float(new.loss_scale) == value
    assert float(tx.update({"w": jnp.ones(3)}, new)[1].loss_scale) == kept
  new = reset(state, jnp.float32(64.0))
  assert float(new.loss_scale) == 64.0 and int(new.policy_state.growth_tracker) == 0


def test_reset_scale_on_an_ensemble_stacked_by_vmap():
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=4.0, growth_interval=3, max_scale=2.0**16
  )
  members = {"w": jnp.ones((3, 3), jnp.float32)}  # 3 members, each with a "w" of shape (3,)
  state = jax.vmap(tx.init)(members)
  _, state = jax.vmap(lambda g, s, p: tx.update(g, s, p))(members, state, members)
  np.testing.assert_array_equal(state.policy_state.growth_tracker, [1, 1, 1])

  def check(new, scales):
    np.testing.assert_array_equal(new.loss_scale, np.asarray(scales, np.float32))
    np.testing.assert_array_equal(new.policy_state.growth_tracker, [0, 0, 0])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
      assert a.dtype == b.dtype and a.shape == b.shape

  # One value sets every member; one per member sets each.
  check(optax_dls.reset_scale(state, 2.0**10), [2.0**10] * 3)
  check(optax_dls.reset_scale(state, np.array([8.0, 16.0, 32.0])), [8.0, 16.0, 32.0])
  check(optax_dls.reset_scale(state, jnp.array([8.0, 16.0, 32.0])), [8.0, 16.0, 32.0])
  with warnings.catch_warnings():  # a list, as NumPy reads it, without a JAX deprecation
    warnings.simplefilter("error")
    check(optax_dls.reset_scale(state, [8.0, 16.0, 32.0]), [8.0, 16.0, 32.0])
  # Traced, per member; the next update keeps each within the policy's range.
  reset = jax.jit(optax_dls.reset_scale)
  new = reset(state, jnp.array([8.0, 16.0, 2.0**30]))
  check(new, [8.0, 16.0, 2.0**30])
  _, new = jax.vmap(lambda g, s, p: tx.update(g, s, p))(members, new, members)
  np.testing.assert_array_equal(new.loss_scale, [8.0, 16.0, 2.0**16])

  # A value of another shape than the members' (3,) is refused, naming the argument.
  for bad in (np.ones(2), np.ones((3, 1)), jnp.ones((1, 3))):
    with pytest.raises(ValueError, match=r"value must be .* shape \(3,\), got shape"):
      optax_dls.reset_scale(state, bad)
  with pytest.raises(ValueError, match=r"value must be .* shape \(3,\), got a traced value"):
    reset(state, jnp.ones(2))
  # A static per-member value is checked member by member.
  with pytest.raises(ValueError, match="value"):
    optax_dls.reset_scale(state, np.array([8.0, math.nan, 4.0]))


@pytest.mark.parametrize("bad", [-4.0, 0.0, float("inf"), 2.0**127])
def test_a_traced_value_that_is_not_a_scale_makes_the_next_step_skip_and_restart(bad):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  params = {"w": jnp.ones(2)}
  state = jax.jit(optax_dls.reset_scale)(tx.init(params), jnp.float32(bad))
  assert np.isnan(float(state.loss_scale))  # not clamped into range
  updates, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert bool(optax_dls.metrics(state)["skipped"]) and not np.any(updates["w"])
  assert float(state.loss_scale) == 8.0


@pytest.mark.parametrize("bad", ["", ("",), ("data", "")])
def test_an_empty_axis_name_is_refused_when_built(bad):
  with pytest.raises(TypeError, match="axis_name must be None, a non-empty string"):
    optax_dls.dynamic_loss_scale(optax.sgd(0.1), axis_name=bad)
