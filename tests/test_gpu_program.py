"""The default step's GPU program at the floor, read from the optimized HLO of a compile for
an H100 target (``benchmarks/gpu_program.py``; no GPU needed, JAX's CUDA plugin is).

Bytes are the kernels' operands and outputs summed: one extra read of the gradients next
to a bare optimizer step is 32 of 28 bytes a parameter for Adam (1.143x) and 24 of 20 for
SGD with momentum (1.2x). A reduction kernel must not compute parameter-sized outputs (the
optimizer's elementwise work run in the reduction emitter), no conditional (its predicate
goes to the host) and no host transfer."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
LEAVES = 64
_PLUGIN = importlib.util.find_spec("jax_plugins") is not None and (
  importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
)
needs_plugin = pytest.mark.skipif(
  not _PLUGIN,
  reason="JAX's CUDA plugin is not installed (pip install jax-cuda12-plugin==<jax's version> "
  "jax-cuda12-pjrt==<jax's version> nvidia-cuda-nvcc-cu12): no GPU program to read",
)


def _run(*args: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  command = [sys.executable, str(BENCHMARKS / "gpu_program.py"), *args]
  return subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
  path = tmp_path_factory.mktemp("gpu") / "h100.json"
  out = _run(
    "--target", "h100_sxm", "--params", "1e8", "--leaves", str(LEAVES), "--cases", "default",
    "--json", str(path),
  )  # fmt: skip
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(path.read_text())["cases"]


@needs_plugin
@pytest.mark.parametrize("inner, bound", [("adam", 1.15), ("sgdm", 1.21)])
def test_the_default_step_is_at_the_floor_on_an_h100(h100, inner, bound):
  name = "dls_auto_update" if inner == "adam" else "dls_sgdm_update"
  case, bare = h100[name], h100[f"bare_{inner}"]
  assert case["gb"] <= bound * bare["gb"], (name, case["gb"], bare["gb"])
  assert case["merged_outputs"] == 0 and case["merged_gb"] == 0, case
  assert case["conditionals"] == 0 and case["host"] == 0, case
  # A reduction per leaf (XLA:GPU splits a large one in two kernels), and the scalar work:
  # the check's vector of per-leaf results and its reduction, the record's bits, and a
  # kernel or a copy for each of the loss-scale state's scalar leaves (20 in all with
  # Adam here; 23 with 1B parameters in 256 leaves, whose vector takes more kernels).
  extra = case["kernels"] - bare["kernels"] - 2 * LEAVES
  assert extra <= 21, (case["kernels"], bare["kernels"])


def test_an_unknown_target_names_the_known_ones():
  out = _run("--target", "h200_nvl")
  assert out.returncode == 2
  assert "unknown GPU target 'h200_nvl'" in out.stderr
  for known in ("a100_sxm_80", "h100_sxm", "h200", "v100"):
    assert known in out.stderr


def test_without_the_plugin_the_install_line_is_given(monkeypatch):
  spec = importlib.util.spec_from_file_location("gpu_program", BENCHMARKS / "gpu_program.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.setattr(module.importlib.util, "find_spec", lambda name: None)
  import jax

  said = module.plugin_missing()
  assert (
    f"pip install jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}" in said
  )
  assert "nvidia-cuda-nvcc-cu12" in said


@pytest.mark.parametrize(
  "args, said",
  [
    (["--params", "0"], "--params must be a positive number"),
    (["--leaves", "0"], "--leaves and --repeats must be at least 1"),
    (["--repeats", "-2"], "--leaves and --repeats must be at least 1"),
    (["--target", str(BENCHMARKS / "gpu_cases.py")], "holds no gpu_device_info"),
    (["--target", str(BENCHMARKS)], "is not a file"),
    (["--cases", "bare_adam,nope"], "unknown cases ['nope']"),
  ],
)
def test_bad_arguments_are_refused_before_anything_compiles(args, said):
  out = _run(*args, "--json", "/tmp/unused.json")
  assert out.returncode == 2 and said in out.stderr, out.stderr[-2000:]
