"""Every transformation the library returns is an ordinary Python object: it survives
copy.copy, copy.deepcopy, cloudpickle (closures, as optax's own transformations are),
rebuilding from its fields and Keras 3's attribute tracking, and the copy gives the same
results. The state pytrees too."""

import copy
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {"w": jnp.array([1.0, -0.0, 2.0]), "b": jnp.array([0.5])}
GOOD = {"w": jnp.array([8.0, 16.0, -8.0]), "b": jnp.array([4.0])}
BAD = {"w": jnp.array([8.0, jnp.inf, -8.0]), "b": jnp.array([4.0])}


def _builders(inner):
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(init_scale=8.0), after=2)
  return {
    "dynamic": lambda: optax_dls.dynamic_loss_scale(inner, init_scale=8.0),
    "dynamic_labels": lambda: optax_dls.dynamic_loss_scale(
      inner, init_scale=8.0, labels={"w": "a", "b": "b"}
    ),
    "static": lambda: optax_dls.static_loss_scale(inner, 8.0),
    "no_loss_scale": lambda: optax_dls.no_loss_scale(inner),
    "wrapped_policies": lambda: optax_dls.loss_scaled(inner, policy),
    "amax": lambda: optax_dls.loss_scaled(inner, optax_dls.amax_policy(init_scale=8.0)),
    "torch_preset": lambda: optax_dls.loss_scaled(
      inner, optax_dls.config.preset("torch", init_scale=8.0)
    ),
    "underflow_stats": lambda: optax_dls.underflow_stats(labels={"w": "a", "b": "b"}),
  }


def _run(tx):
  """A finite and a non-finite update: every output leaf."""
  state = tx.init(PARAMS)
  updates, state = tx.update(GOOD, state, PARAMS)
  params = optax.apply_updates(PARAMS, updates)
  out = jax.tree.leaves((updates, state, tx.update(BAD, state, params)))
  return [np.asarray(x).tobytes() for x in out]


COPIES = {
  "copy": copy.copy,
  "deepcopy": copy.deepcopy,
  "rebuilt from its fields": lambda tx: type(tx)(*tx),
  "_replace": lambda tx: tx._replace(init=tx.init),
}


@pytest.mark.parametrize("name", sorted(_builders(None)))
def test_a_copy_gives_the_same_results(name):
  tx = _builders(optax.adam(1e-2))[name]()
  ref = _run(tx)
  copies = {how: f(tx) for how, f in COPIES.items()}
  cloudpickle = pytest.importorskip("cloudpickle")
  copies["cloudpickle"] = cloudpickle.loads(cloudpickle.dumps(tx))  # closures too
  for how, copied in copies.items():
    assert type(copied) is type(tx), how
    assert _run(copied) == ref, how


def test_the_state_pytrees_copy_and_pickle():
  tx = optax_dls.loss_scaled(
    optax.adam(1e-2), optax_dls.fp32_fallback(optax_dls.dynamic_policy(init_scale=8.0))
  )
  state = tx.init(PARAMS)
  _, state = tx.update(BAD, state, PARAMS)  # a non-finite record in it
  for copied in (copy.copy(state), copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
    assert type(copied) is type(state)
    assert jax.tree.structure(copied) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(state), strict=True):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  names = optax_dls.nonfinite_leaves(pickle.loads(pickle.dumps(state)), PARAMS)
  assert names == optax_dls.nonfinite_leaves(state, PARAMS) != {}


def test_keras_attribute_tracking_keeps_the_transformation(monkeypatch):
  monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "jax"))
  keras = pytest.importorskip("keras")

  class Holder(keras.layers.Layer):
    def __init__(self, tx):
      super().__init__()
      self.tx = tx

  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=8.0)
  held = Holder(tx).tx
  assert _run(held) == _run(tx)
