"""docs/guide/recompute.md: ``max_tries`` is 3 by default and at most 64."""

import inspect

import optax
import pytest

import optax_dls


def test_max_tries_defaults_to_3_and_takes_at_most_64():
  assert inspect.signature(optax_dls.value_and_grad).parameters["max_tries"].default == 3
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0))
  assert callable(optax_dls.value_and_grad(lambda p: p, tx, max_tries=64))
  with pytest.raises(ValueError, match="max_tries=65"):
    optax_dls.value_and_grad(lambda p: p, tx, max_tries=65)
