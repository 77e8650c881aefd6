"""Test setup, before any JAX computation: XLA's CPU compiler turned down (``tests/_xla.py``:
about half the suite's time; ``OPTAX_DLS_TEST_XLA=default`` keeps XLA's defaults), and 8
virtual CPU devices."""

import _xla

_xla.turn_down()

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest


@pytest.fixture(params=["cond", "where"])
def lowering(request):
  """Each skip lowering in turn: every contract test runs under both."""
  return request.param
