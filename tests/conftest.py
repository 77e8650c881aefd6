"""Test setup, before any JAX computation: 8 virtual CPU devices, and XLA's CPU compiler
turned down.

The tests check values, bits, types and decisions, and spend most of their time
compiling many small programs: XLA's backend optimizations off, its classic kernel
emitters, and machine code emitted in one piece (not split for threads that small
kernels do not keep busy) take about half the time. A test about the compiled program
itself (its copies, its scratch memory, or that two programs give the same bits)
compiles with XLA's defaults (``tests/_compat.py``'s ``XLA_DEFAULTS``). Set
``OPTAX_DLS_TEST_XLA=default`` to run everything with XLA's defaults. Subprocesses of
the tests inherit the setting.
"""

import os

if os.environ.get("OPTAX_DLS_TEST_XLA") != "default":
  os.environ["XLA_FLAGS"] = " ".join(
    [
      os.environ.get("XLA_FLAGS", ""),
      "--xla_backend_optimization_level=0",
      "--xla_cpu_use_fusion_emitters=false",
      "--xla_cpu_parallel_codegen_split_count=1",
    ]
  ).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest


@pytest.fixture(params=["cond", "where"])
def lowering(request):
  """Each skip lowering in turn: every contract test runs under both."""
  return request.param
