"""Two processes on localhost (jax.distributed, gloo): an inf seen by one process skips both,
and every device of both names the leaf."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 100


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module", params=["cond", "where"])
def results(tmp_path_factory, request):
  """Both workers' results, under each skip lowering in turn."""
  tmp = tmp_path_factory.mktemp("multiprocess")
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "OPTAX_DLS_TEST_LOWERING": request.param}
  env.pop("XLA_FLAGS", None)
  procs, logs = [], [tmp / f"p{pid}.log" for pid in range(2)]
  try:
    for pid in range(2):
      with open(logs[pid], "w") as log:
        procs.append(
          subprocess.Popen(
            [sys.executable, str(WORKER), str(pid), str(port), str(tmp / f"p{pid}.json")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
          )
        )
    for p in procs:
      p.wait(timeout=TIMEOUT_S)
    for p, log in zip(procs, logs):
      assert p.returncode == 0, f"worker exited with {p.returncode}:\n{log.read_text()[-4000:]}"
  finally:
    for p in procs:  # also on timeout or failure: no worker outlives the test
      if p.poll() is None:
        p.kill()
        p.wait()
  return [json.loads((tmp / f"p{pid}.json").read_text()) for pid in range(2)]


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_inf_in_process_1_skips_both_processes(results, mode):
  assert [r["process_index"] for r in results] == [0, 1]
  for r in results:
    step0 = r[mode]["step0"]
    assert step0["finite"] == [False, False]  # every local device of every process skipped
    assert step0["scales"] == [2.0**9, 2.0**9]
    for k, v in step0["params"].items():  # parameters unchanged by the skipped step
      initial = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3) if k == "w" else np.ones(3)
      np.testing.assert_array_equal(np.asarray(v), initial)
  assert results[0][mode] == results[1][mode]


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_every_device_of_both_processes_names_the_leaf_of_process_1(results, mode):
  for r in results:
    for step in ("step0", "step1"):  # the clean step 1 keeps the record of step 0
      seen = r[mode][step]
      assert seen["nonfinite"] == [{"leaves": {"w": "inf"}, "step": 1}] * 2, step
      assert seen["nonfinite_leaves"] == {"w": "inf"} and seen["nonfinite_step"] == 1
  assert results[0][mode] == results[1][mode]


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_clean_step_matches_single_device(results, mode):
  for r in results:
    step1 = r[mode]["step1"]
    assert step1["finite"] == [True, True] and step1["scales"] == [2.0**9, 2.0**9]
    for k, v in step1["params"].items():
      np.testing.assert_allclose(np.asarray(v), np.asarray(r["reference"][k]), rtol=1e-6)
      assert not np.array_equal(np.asarray(v), np.asarray(r[mode]["step0"]["params"][k]))
