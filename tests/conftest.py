"""Test setup, before any JAX computation: XLA's CPU compiler turned down (``tests/_xla.py``:
about half the suite's time; ``OPTAX_DLS_TEST_XLA=default`` keeps XLA's defaults), 8
virtual CPU devices, and ``jax_numpy_rank_promotion="raise"``. The suite runs on the CPU,
also where JAX's CUDA plugin is installed (``JAX_PLATFORMS=cpu`` unless set:
``test_gpu_program.py`` compiles for GPU targets in processes of its own)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _xla

_xla.turn_down()

import jax

jax.config.update("jax_num_cpu_devices", 8)
# As strict trainers run: no implicit rank promotion, in the library and in the tests' own
# models (the documentation's snippets run as they are printed, under "allow").
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest


@pytest.fixture(params=["cond", "where"])
def lowering(request):
  """Each skip lowering in turn: every contract test runs under both."""
  return request.param
