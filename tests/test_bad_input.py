"""Input that once slipped through: each gets its named error, or the right answer."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import enable_x64

import optax_dls
from optax_dls import config

PARAMS = {"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)}


def _nan_in_b():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  grads = dict(PARAMS, b=jnp.array([1.0, jnp.nan, 1.0]))
  _, state = tx.update(grads, tx.init(PARAMS), PARAMS)
  return state


def test_nonfinite_leaves_names_the_leaf_and_refuses_parameters_that_cannot_be_the_state_s():
  state = _nan_in_b()
  assert optax_dls.nonfinite_leaves(state, PARAMS) == {"b": "nan"}
  with pytest.raises(ValueError, match=r"params is not the tree the state was built for"):
    optax_dls.nonfinite_leaves(state, {"x": jnp.ones(1)})  # the NaN would be lost
  with pytest.raises(ValueError, match=r"has 1 floating leaves \(q\)"):
    optax_dls.nonfinite_leaves(state, ["q"])
  logged = dict(optax_dls.metrics(state))  # a logged row: the leaf count is checked too
  with pytest.raises(ValueError, match=r"params has 1 floating leaves.*leaf 1 is recorded"):
    optax_dls.nonfinite_leaves(logged, {"x": jnp.ones(1)})
  for bad in (None, "abc", ["a", 1]):
    with pytest.raises(TypeError, match="params must be the parameters"):
      optax_dls.nonfinite_leaves(state, bad)


@pytest.mark.parametrize("make", [optax_dls.dynamic_loss_scale, optax_dls.no_loss_scale])
@pytest.mark.parametrize("bad", ["x", {"a": 1.0}, 1 + 2j, jnp.array([1, 2])])
def test_a_loss_that_is_not_a_real_floating_array_is_named(bad, make):
  tx = make(optax.sgd(0.1))
  with pytest.raises(TypeError, match="loss must be None or a real floating-point array"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, loss=bad)


@pytest.mark.parametrize("lowering", ["auto", "cond", "where"])
def test_finite_float64_gradients_past_the_float32_range_are_finite_under_x64(lowering):
  with enable_x64():
    params = {"w": jnp.ones(2, jnp.float64)}
    assert bool(optax_dls.all_finite({"w": jnp.array([1e300, 1.0])}))
    assert not bool(optax_dls.all_finite({"w": jnp.array([jnp.inf, 1.0])}))
    tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, skip_lowering=lowering)
    for value, finite in ((1e300, True), (1e39, True), (np.inf, False)):
      _, state = jax.jit(tx.update)({"w": jnp.array([value, 1.0])}, tx.init(params), params)
      assert bool(state.last_step_finite) == finite, value
    assert optax_dls.nonfinite_leaves(state, params) == {"w": "inf"}


def test_the_library_s_own_transformations_pickle_as_optax_s_do():
  """Closures, as optax's own transformations: cloudpickle carries them."""
  cloudpickle = pytest.importorskip("cloudpickle")
  for tx in (optax_dls.recompute_stats(), optax_dls.underflow_stats()):
    copied = pickle.loads(cloudpickle.dumps(tx))
    state = copied.init(PARAMS)
    assert jax.tree.structure(copied.update(PARAMS, state, PARAMS)[1]) == jax.tree.structure(
      tx.update(PARAMS, tx.init(PARAMS), PARAMS)[1]
    )


def test_a_configuration_with_underflow_stats_checks_inner_first():
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    config.from_config({"underflow_stats": True}, 5)


@pytest.mark.parametrize(
  "inner",
  [
    lambda: optax_dls.dynamic_loss_scale(optax.adam(1.0)),
    lambda: optax.chain(optax.clip(1.0), optax_dls.static_loss_scale(optax.sgd(1.0), 2.0)),
  ],
  ids=["direct", "in_a_chain"],
)
def test_an_inner_optimizer_already_loss_scaled_is_refused_at_init(inner):
  tx = optax_dls.dynamic_loss_scale(inner())
  with pytest.raises(ValueError, match="inner is already loss-scaled.*Wrap the optimizer once"):
    tx.init({"w": jnp.ones(2)})
