"""flax nnx state is named by its variables' paths, without the ``/value`` of their arrays."""

import jax.numpy as jnp
import optax
import pytest

import optax_dls
from optax_dls._access.names import leaf_names

nnx = pytest.importorskip("flax.nnx")


def test_nnx_state_names_have_no_value_suffix():
  class Model(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

  params = nnx.state(Model(), nnx.Param)
  assert leaf_names(params) == ["dense/bias", "dense/kernel"]
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0))
  state = tx.init(params)
  grads = nnx.to_pure_dict(params)
  grads["dense"]["kernel"] = jnp.full((2, 3), jnp.nan)
  _, state = tx.update(grads, state)
  assert optax_dls.nonfinite_leaves(state, params) == {"dense/kernel": "nan"}
