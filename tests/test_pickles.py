"""States and public types pickle (under the module each is written in) and load back equal."""

import inspect
import pickle
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls._features.casting import CastPolicy
from optax_dls._policies.base import GradStats
from optax_dls._util.locate_report import LocateReport


def _params():
  return {"b": jnp.zeros(2), "w": jnp.ones((2, 3))}


def _tx():
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy())
  inner = optax.chain(optax_dls.underflow_stats(), optax_dls.recompute_stats(), optax.adam(1e-2))
  return optax_dls.loss_scaled(inner, policy)


def _trained(tx, params):
  """What the pickled state went through: one finite step, one with an inf in ``b``."""
  state = tx.init(params)
  g = {"b": jnp.ones(2), "w": jnp.full((2, 3), 3.0)}
  _, state = tx.update(g, state, params)
  _, state = tx.update({"b": jnp.array([1.0, jnp.inf]), "w": g["w"]}, state, params)
  return state


def test_a_state_pickles_and_loads_back_equal():
  state = _trained(_tx(), _params())
  amax = optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.amax_policy()).init(_params())
  again = pickle.loads(pickle.dumps((state, amax)))
  assert jax.tree.structure(again) == jax.tree.structure((state, amax))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves((state, amax)), strict=True):
    np.testing.assert_array_equal(a, b)
  assert optax_dls.nonfinite_leaves(again[0], _params()) == {"b": "inf"}


@pytest.mark.parametrize(
  "value",
  [
    optax_dls.cast_policy("p=f32,c=f16,o=f32"),
    GradStats(jnp.bool_(True), jnp.int32(3), jnp.float32(1.0), jnp.float32(2.0)),
    optax_dls.SkipAlerts(),
  ],
  ids=lambda v: type(v).__name__,
)
def test_public_types_pickle(value):
  assert type(pickle.loads(pickle.dumps(value))) is type(value)


def test_a_locate_report_pickles():
  params = {"w": jnp.ones(2)}
  report = optax_dls.locate(lambda p: jnp.sum(p["w"].astype(jnp.float16) * 1e5), params, scale=1.0)
  assert pickle.loads(pickle.dumps(report)) == report


@pytest.mark.parametrize(
  "kind",
  [optax_dls.LossScaleState, GradStats, CastPolicy, LocateReport],
  ids=lambda k: k.__name__,
)
def test_the_pickled_types_keep_their_module_their_hints_and_their_source(kind):
  """Each type pickles where it is written: typing.get_type_hints and inspect.getsource
  read it."""
  assert kind.__module__.startswith("optax_dls._")
  assert typing.get_type_hints(kind)
  assert f"class {kind.__name__}" in inspect.getsource(kind)
