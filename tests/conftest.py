"""Test setup: 8 virtual CPU devices, set before any JAX computation."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest


@pytest.fixture(params=["cond", "where"])
def lowering(request):
  """Each skip lowering in turn: every contract test runs under both."""
  return request.param
