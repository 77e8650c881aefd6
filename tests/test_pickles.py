"""States and public types pickle under their public module path, and a state pickled before
the package had folders still loads and trains on."""

import inspect
import io
import pickle
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls._features.casting import CastPolicy
from optax_dls._policies.base import GradStats
from optax_dls._util.locate_report import LocateReport

DATA = Path(__file__).resolve().parent / "data"


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


class _Recording(pickle.Unpickler):
  """Loads a pickle, recording every ``(module, name)`` it looks up."""

  def __init__(self, data):
    super().__init__(io.BytesIO(data))
    self.found = set()

  def find_class(self, module, name):
    self.found.add((module, name))
    return super().find_class(module, name)


def _globals(data):
  """The ``(module, name)`` pairs a pickle names."""
  loader = _Recording(data)
  loader.load()
  return loader.found


def _modules(data):
  """The module paths a pickle names."""
  return {m for m, _ in _globals(data)}


def test_a_state_pickles_under_public_paths_only():
  state = _trained(_tx(), _params())
  amax = optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.amax_policy()).init(_params())
  data = pickle.dumps((state, amax))
  ours = {m for m in _modules(data) if m.startswith("optax_dls")}
  assert ours == {"optax_dls"}, ours
  again = pickle.loads(data)
  assert jax.tree.structure(again) == jax.tree.structure((state, amax))


@pytest.mark.parametrize(
  "value",
  [
    optax_dls.cast_policy("p=f32,c=f16,o=f32"),
    GradStats(jnp.bool_(True), jnp.int32(3), jnp.float32(1.0), jnp.float32(2.0)),
    optax_dls.SkipAlerts(),
  ],
  ids=lambda v: type(v).__name__,
)
def test_public_types_pickle_as_optax_dls_names(value):
  data = pickle.dumps(value)
  assert {m for m in _modules(data) if m.startswith("optax_dls")} == {"optax_dls"}
  assert type(pickle.loads(data)) is type(value)


def test_a_state_pickled_by_the_flat_layout_loads_and_trains_on():
  """tests/data/state_flat_layout.pkl was written by the package before its folders
  (``optax_dls._state.LossScaleState``, ``optax_dls._localisation.NonFiniteRecord``, ...),
  from the steps of ``_trained``, leaves as numpy arrays (``jax.device_get``)."""
  saved = pickle.loads((DATA / "state_flat_layout.pkl").read_bytes())
  tx, params = _tx(), _params()
  now = _trained(tx, params)
  old = jax.tree.map(jnp.asarray, saved["dynamic"])
  assert jax.tree.structure(old) == jax.tree.structure(now)
  for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(now), strict=True):
    np.testing.assert_array_equal(a, b)
  assert optax_dls.nonfinite_leaves(old, params) == {"b": "inf"}
  g = {"b": jnp.ones(2), "w": jnp.ones((2, 3))}
  old = jax.tree.map(lambda a, b: jnp.asarray(a, b.dtype), old, now)
  u_old, _ = tx.update(g, old, params)
  u_now, _ = tx.update(g, now, params)
  for a, b in zip(jax.tree.leaves(u_old), jax.tree.leaves(u_now), strict=True):
    np.testing.assert_array_equal(a, b)
  amax = jax.tree.map(jnp.asarray, saved["amax"])
  fresh = optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.amax_policy()).init(params)
  assert jax.tree.structure(amax) == jax.tree.structure(fresh)


def test_a_locate_report_pickles_by_public_name():
  params = {"w": jnp.ones(2)}
  report = optax_dls.locate(lambda p: jnp.sum(p["w"].astype(jnp.float16) * 1e5), params, scale=1.0)
  data = pickle.dumps(report)
  assert {m for m in _modules(data) if m.startswith("optax_dls")} == {"optax_dls"}
  assert pickle.loads(data) == report


@pytest.mark.parametrize(
  "kind",
  [optax_dls.LossScaleState, GradStats, CastPolicy, LocateReport],
  ids=lambda k: k.__name__,
)
def test_the_pickled_types_keep_their_module_their_hints_and_their_source(kind):
  """Pickling by name leaves each type where it is written: typing.get_type_hints and
  inspect.getsource read it as before."""
  assert kind.__module__.startswith("optax_dls._")
  assert typing.get_type_hints(kind)
  assert f"class {kind.__name__}" in inspect.getsource(kind)


def test_old_module_paths_import_as_before():
  import optax_dls._localisation
  import optax_dls._state

  assert optax_dls._state.LossScaleState is optax_dls.LossScaleState
  assert optax_dls._localisation.NonFiniteRecord is type(
    optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(1)}).nonfinite
  )
