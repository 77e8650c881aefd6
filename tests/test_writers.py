"""MetricsWriter: JSONL + TensorBoard every k steps, host transfer only on logged steps."""

import glob
import json
import math

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dls
from optax_dls import writers


def _state_after(kinds):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, alerts=False, underflow_stats=True)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  states = []
  for k in kinds:
    _, state = update({"w": jnp.full(3, k)}, state, params)
    states.append(state)
  return states


def test_logs_every_k_steps_and_transfers_only_then(tmp_path, monkeypatch):
  calls = []
  real_get = jax.device_get
  monkeypatch.setattr(writers.jax, "device_get", lambda x: calls.append(1) or real_get(x))
  states = _state_after([1.0, jnp.inf, 1.0, 1.0, jnp.inf, 1.0, 1.0])
  with writers.MetricsWriter(tmp_path, every=3, run_name="exp") as w:
    logged = [w.log(step, optax_dls.metrics(s), loss=jnp.float32(step) / 2) for step, s in enumerate(states)]
  assert logged == [True, False, False, True, False, False, True]
  assert len(calls) == 3
  rows = [json.loads(line) for line in open(tmp_path / writers.JSONL_NAME)]
  assert [r["step"] for r in rows] == [0, 3, 6]
  for r, step in zip(rows, (0, 3, 6)):
    expected = jax.device_get(optax_dls.metrics(states[step]))
    assert r["run"] == "exp" and r["loss"] == step / 2
    for key, value in expected.items():
      assert r[key] == pytest.approx(value.item(), nan_ok=True), key
  assert rows[1]["skip_count"] == 1 and rows[1]["skipped"] is False and rows[2]["skip_count"] == 2


def test_tensorboard_events_hold_the_same_scalars(tmp_path):
  states = _state_after([1.0, jnp.inf])
  with writers.MetricsWriter(tmp_path, every=1) as w:
    for step, s in enumerate(states):
      w.log(step, optax_dls.metrics(s), loss=1.5)
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  tb = writers.read_tensorboard(event_file)
  js = writers.read_jsonl(tmp_path / writers.JSONL_NAME)
  assert [r["step"] for r in tb] == [0, 1]
  for a, b in zip(tb, js):
    for key in ("loss_scale", "skip_count", "skipped", "update_ratio", "loss", "underflow/zero_frac"):
      assert a[key] == pytest.approx(float(b[key]), rel=1e-6), key


def test_nan_and_bool_values_round_trip(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.log(0, {"grad_norm": jnp.float32(jnp.nan), "skipped": jnp.bool_(True)})
  (row,) = writers.read_jsonl(tmp_path / writers.JSONL_NAME)
  assert math.isnan(row["grad_norm"]) and row["skipped"] is True


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="every"):
    writers.MetricsWriter(tmp_path, every=0)
  with pytest.raises(ValueError, match="tensorboard"):
    writers.MetricsWriter(tmp_path, tensorboard=False, jsonl=False)
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    with pytest.raises(TypeError, match="step"):
      w.log(jnp.int32(0), {})
    with pytest.raises(ValueError, match="scalar"):
      w.log(0, {"x": jnp.ones(2)})


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensorboard="no"), "tensorboard"),
    (dict(tensorboard=False, jsonl=1), "jsonl"),
    (dict(tensorboard=False, run_name=5), "run_name"),
])
def test_constructor_flags_must_have_their_types(tmp_path, kwargs, match):
  with pytest.raises(TypeError, match=match):
    writers.MetricsWriter(tmp_path, **kwargs)


@pytest.mark.parametrize("metrics, error, match", [
    ({"step": 99}, ValueError, "'step'"),
    ({"run": "other"}, ValueError, "'run'"),
    ({"a": {"b": 1}}, TypeError, "'a'"),
    ({"c": 1 + 2j}, TypeError, "'c'"),
    ({"v": jnp.ones(3)}, ValueError, "'v'.*shape"),
    ({1: 2.0}, TypeError, "names must be strings"),
    (None, TypeError, "metrics must be a mapping"),
])
def test_reserved_names_and_non_scalar_values_are_refused(tmp_path, metrics, error, match):
  with writers.MetricsWriter(tmp_path, tensorboard=False, run_name="r") as w:
    with pytest.raises(error, match=match):
      w.log(0, metrics)
    assert w.log(0, {"ok": 1.0})
  (row,) = writers.read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row == {"step": 0, "run": "r", "ok": 1.0}


def test_binary_jsonl_is_read_as_malformed_lines(tmp_path):
  path = tmp_path / writers.JSONL_NAME
  path.write_bytes(bytes(range(256)) + b'\n{"step": 3}\n')
  assert writers.read_jsonl(path) == [{"step": 3}]
