"""The promises of the ``optax_dls.checkpoint`` docstrings not held elsewhere."""

from __future__ import annotations

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
import optax_dls.checkpoint

PARAMS = {"w": jnp.ones(2)}


def test_importing_optax_dls_checkpoint_does_not_import_orbax():
  code = (
    "import sys, optax_dls.checkpoint; "
    "assert not [m for m in sys.modules if m.split('.')[0] == 'orbax']"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


def test_settled_keeps_a_scale_in_range_silently_and_changes_nothing_else():
  tree = {"params": PARAMS, "opt_state": optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)}
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), max_scale=2.0**20)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert optax_dls.checkpoint._settled(tree, tx) is tree
  lowered = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**5, max_scale=2.0**10)
  with pytest.warns(UserWarning, match=r"2\*\*15 -> 1024.0 .*\[1.0, 1024.0\]"):
    out = optax_dls.checkpoint._settled(tree, lowered)
  assert float(optax_dls.find_state(out).loss_scale) == 2.0**10
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, tree)
  kept = optax_dls.find_state(out)._replace(loss_scale=optax_dls.find_state(tree).loss_scale)
  same = jax.tree.map(
    lambda a, b: np.array_equal(a, b, equal_nan=True), out | {"opt_state": kept}, tree
  )
  assert jax.tree.all(same)  # only the scale moved


def test_restore_from_a_directory_without_a_checkpoint_is_file_not_found(tmp_path):
  tree = {"params": PARAMS, "opt_state": optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)}
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    optax_dls.checkpoint.restore(tmp_path, tree)


def test_into_loss_scaled_converts_dtypes_and_refuses_an_abstract_loss_scale_state():
  raw = {
    "params": {"w": np.ones(2)},
    "opt_state": [{"count": np.int64(3), "mu": {"w": np.zeros(2)}, "nu": {"w": np.zeros(2)}}, None],
  }
  tx = optax_dls.dynamic_loss_scale(optax.adam(0.1))
  target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
  state = optax_dls.checkpoint.into_loss_scaled(raw, target)
  assert jax.tree.map(lambda x: x.dtype, state) == jax.tree.map(lambda x: x.dtype, target)
  abstract_params = target | {
    "params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
  }
  assert optax_dls.checkpoint.into_loss_scaled(raw, abstract_params)["params"]["w"].tolist() == [
    1,
    1,
  ]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
  with pytest.raises(
    TypeError,
    match=r"state at opt_state must hold arrays, got .* at opt_state.loss_scale",
  ):
    optax_dls.checkpoint.into_loss_scaled(raw, abstract)


@pytest.mark.parametrize("tx", [optax.sgd(0.1), 3])
def test_restore_names_a_tx_that_is_not_loss_scaled_before_reading(tmp_path, tx):
  tree = {"params": PARAMS, "opt_state": optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)}
  with pytest.raises(TypeError, match="tx must be the loss-scaled transformation"):
    optax_dls.checkpoint.restore(tmp_path, tree, tx=tx)
