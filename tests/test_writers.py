"""MetricsWriter: JSONL + TensorBoard every k steps, host transfer only on logged steps."""

import fractions
import glob
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls import writers


def _state_after(kinds):
  tx = optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.underflow_stats(), optax.sgd(0.1)), init_scale=64.0
  )
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
    logged = [
      w.log(step, optax_dls.metrics(s), loss=jnp.float32(step) / 2) for step, s in enumerate(states)
    ]
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
    for key in (
      "loss_scale",
      "skip_count",
      "skipped",
      "update_ratio",
      "loss",
      "underflow/zero_frac",
    ):
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


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(tensorboard="no"), "tensorboard"),
    (dict(tensorboard=False, jsonl=1), "jsonl"),
    (dict(tensorboard=False, run_name=5), "run_name"),
  ],
)
def test_constructor_flags_must_have_their_types(tmp_path, kwargs, match):
  with pytest.raises(TypeError, match=match):
    writers.MetricsWriter(tmp_path, **kwargs)


@pytest.mark.parametrize(
  "metrics, error, match",
  [
    ({"step": 99}, ValueError, "'step'"),
    ({"run": "other"}, ValueError, "'run'"),
    ({"a": {"b": 1}}, TypeError, "'a'"),
    ({"c": 1 + 2j}, TypeError, "'c'"),
    ({"v": jnp.ones(3)}, ValueError, "'v'.*shape"),
    ({1: 2.0}, TypeError, "names must be strings"),
    (None, TypeError, "metrics must be a mapping"),
  ],
)
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


@pytest.mark.parametrize(
  "value, expected",
  [
    (jnp.asarray(1.5, jnp.bfloat16), 1.5),
    (jnp.asarray(1.5, jnp.float16), 1.5),
    (np.float16(1.5), 1.5),
    (jnp.asarray(-2.0, jnp.float8_e4m3fn), -2.0),
    (jnp.asarray(0.25, jnp.float64) if jax.config.jax_enable_x64 else np.float64(0.25), 0.25),
    (jnp.asarray(3, jnp.int4), 3),
    (np.uint8(200), 200),
    (np.uint64(2**64 - 1), 2**64 - 1),
    (10**30, 10**30),
    (np.bool_(True), True),
    (jnp.asarray(False), False),
    (np.asarray(7, np.int16), 7),
    (fractions.Fraction(3, 4), 0.75),
  ],
)
def test_any_real_scalar_of_jax_or_numpy_is_written(tmp_path, value, expected):
  with writers.MetricsWriter(tmp_path) as w:
    assert w.log(0, {"m": value}, loss=value)
  (row,) = writers.read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row["m"] == expected and row["loss"] == expected and type(row["m"]) is type(expected)
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  (tb,) = writers.read_tensorboard(event_file)
  assert tb["m"] == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize(
  "value", [jnp.asarray(1 + 2j), np.asarray("text"), object(), np.datetime64(1, "s")]
)
def test_values_that_are_not_real_scalars_raise_type_error_naming_the_metric(tmp_path, value):
  with (
    writers.MetricsWriter(tmp_path, tensorboard=False) as w,
    pytest.raises(TypeError, match="'m'"),
  ):
    w.log(0, {"m": value})


def test_appending_to_a_file_whose_last_line_was_cut_starts_a_new_line(tmp_path):
  path = tmp_path / writers.JSONL_NAME
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.log(0, {"loss_scale": 2.0})
    w.log(1, {"loss_scale": 4.0})
  text = path.read_bytes()
  path.write_bytes(text[:-7])  # a crash in the middle of the last row
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:  # the resumed run
    w.log(1, {"loss_scale": 8.0})
    w.log(2, {"loss_scale": 16.0})
  rows = writers.read_jsonl(path)
  assert [(r["step"], r["loss_scale"]) for r in rows] == [(0, 2.0), (1, 8.0), (2, 16.0)]
  bad = []
  writers.read_jsonl(path, on_bad_line=lambda n, why: bad.append(n))
  assert bad == [2]  # the cut line, on a line of its own


def test_two_writers_opened_in_the_same_second_on_one_folder_lose_nothing(tmp_path, monkeypatch):
  with monkeypatch.context() as m:
    m.setattr(time, "time", lambda: 1.7e9)  # both event files named in the same second
    a = writers.MetricsWriter(tmp_path, run_name="a")
    b = writers.MetricsWriter(tmp_path, run_name="b")
  for step in range(20):
    a.log(step, {"from_a": float(step)})
    b.log(step, {"from_b": float(-step)})
  a.close()
  b.close()
  rows = writers.read_jsonl(tmp_path / writers.JSONL_NAME)
  assert sorted((r["run"], r["step"]) for r in rows) == sorted(
    (n, s) for n in "ab" for s in range(20)
  )
  tb = [
    r
    for f in glob.glob(str(tmp_path / "events.out.tfevents*"))
    for r in writers.read_tensorboard(f)
  ]
  assert sorted(r["from_a"] for r in tb if "from_a" in r) == list(range(20))
  assert sorted(-r["from_b"] for r in tb if "from_b" in r) == list(range(20))


@pytest.mark.parametrize("kwargs", [{}, {"jsonl": False}, {"tensorboard": False}, {"every": 5}])
def test_any_use_after_close_raises(tmp_path, kwargs):
  w = writers.MetricsWriter(tmp_path, **kwargs)
  w.log(0, {"a": 1.0})
  w.close()
  for step in (0, 1):  # a step that would be logged, and one that would not
    with pytest.raises(ValueError, match="closed"):
      w.log(step, {"a": 1.0})
  with pytest.raises(ValueError, match="closed"):
    w.flush()
  w.close()  # closing twice is fine


def test_a_bad_jsonl_line_costs_that_line_only(tmp_path):
  path = tmp_path / writers.JSONL_NAME
  lines = [
    '{"step": 0, "a": 1}',
    '{"step": 1, "a": ' + "9" * 5000 + "}",
    "[" * 100000 + "]" * 100000,
    "not json",
    '{"step": 2, "a": 3}',
    "[1, 2]",
    '{"no_step": 1}',
    "",
    '{"step": 3, "a": 4',
  ]
  path.write_text("\n".join(lines))
  rows = writers.read_jsonl(path)
  assert [r["step"] for r in rows] == [0, 2]
  bad = []
  assert writers.read_jsonl(path, on_bad_line=lambda n, why: bad.append((n, why))) == rows
  assert [n for n, _ in bad] == [2, 3, 4, 6, 7, 9]
  assert all(isinstance(why, str) and why for _, why in bad)


def _event_file(tmp_path, steps=6):
  with writers.MetricsWriter(tmp_path, jsonl=False) as w:
    for step in range(steps):
      w.log(step, {"loss_scale": 2.0**step, "skip_count": step})
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  return event_file


def _record_offsets(data):
  offsets, pos = [], 0
  while pos < len(data):
    offsets.append(pos)
    pos += 16 + int.from_bytes(data[pos : pos + 8], "little")
  return offsets


@pytest.mark.parametrize("where", ["data", "length"])
def test_a_corrupt_event_record_costs_that_record_only(tmp_path, where):
  path = _event_file(tmp_path)
  intact = writers.read_tensorboard(path)
  data = bytearray(pathlib.Path(path).read_bytes())
  offsets = _record_offsets(data)
  # Record 0 is the file version; then loss_scale and skip_count alternate, steps 0, 1, ...
  victim = offsets[4]  # skip_count of step 1
  if where == "data":
    data[offsets[5] - 6] ^= 0x40  # a bit of its float value
  else:
    data[victim + 1] ^= 0xFF  # the record's length
  pathlib.Path(path).write_bytes(bytes(data))
  expected = [dict(r) for r in intact]
  del expected[1]["skip_count"]
  assert writers.read_tensorboard(path) == expected
  bad = []
  writers.read_tensorboard(path, on_bad_record=lambda offset, why: bad.append(offset))
  assert bad == [victim]


def test_reader_callbacks_must_be_callable(tmp_path):
  path = _event_file(tmp_path, steps=1)
  with pytest.raises(TypeError, match="on_bad_record"):
    writers.read_tensorboard(path, on_bad_record="print")
  (tmp_path / "m.jsonl").write_text('{"step": 0}\n')
  with pytest.raises(TypeError, match="on_bad_line"):
    writers.read_jsonl(tmp_path / "m.jsonl", on_bad_line=1)


@pytest.mark.parametrize(
  "call",
  [
    lambda: writers.MetricsWriter(None),
    lambda: writers.MetricsWriter(3, tensorboard=False),
    lambda: writers.read_jsonl(None),
    lambda: writers.read_tensorboard(b"events.out.tfevents.1"),
  ],
)
def test_paths_must_be_str_or_pathlike(call):
  with pytest.raises(TypeError, match=r"(logdir|path) must be a str or os.PathLike"):
    call()
