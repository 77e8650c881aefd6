"""MetricsWriter: JSONL + TensorBoard every k steps, host transfer only on logged steps."""

import fractions
import glob
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _logs_read import read_jsonl, read_tensorboard

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

  def device_get(x):  # counts the calls that move device arrays (host values cost nothing)
    if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
      calls.append(1)
    return real_get(x)

  monkeypatch.setattr(writers.jax, "device_get", device_get)
  states = _state_after([1.0, jnp.inf, 1.0, 1.0, jnp.inf, 1.0, 1.0])
  with writers.MetricsWriter(tmp_path, every=3, run_name="exp") as w:
    logged = [
      w.log(step, optax_dls.metrics(s), loss=jnp.float32(step) / 2) for step, s in enumerate(states)
    ]
  assert logged == [True, False, False, True, False, False, True]
  assert len(calls) == 3
  rows = [json.loads(line) for line in (tmp_path / writers.JSONL_NAME).read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 3, 6]
  for r, step in zip(rows, (0, 3, 6)):
    expected = jax.device_get(optax_dls.metrics(states[step]))
    assert r["run"] == "exp" and r["loss"] == step / 2
    for key, value in expected.items():
      # The packed words are written as names; the names' checksum is not written.
      if key not in ("nonfinite_leaves", "nonfinite_nan", "nonfinite_names_digest"):
        assert r[key] == pytest.approx(value.item(), nan_ok=True), key
  assert rows[1]["skip_count"] == 1 and rows[1]["skipped"] is False and rows[2]["skip_count"] == 2
  # Updates 2 and 5 overflowed: rows 3 and 6 name the leaf (numbered: no params given).
  assert [r["nonfinite_step"] for r in rows] == [0, 2, 5]
  assert [r.get("nonfinite_leaves") for r in rows] == [None, {"leaf 0": "inf"}, {"leaf 0": "inf"}]
  assert "nonfinite_nan" not in rows[1]


def test_tensorboard_events_hold_the_same_scalars(tmp_path):
  states = _state_after([1.0, jnp.inf])
  with writers.MetricsWriter(tmp_path, every=1) as w:
    for step, s in enumerate(states):
      w.log(step, optax_dls.metrics(s), loss=1.5)
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  tb = read_tensorboard(event_file)
  js = read_jsonl(tmp_path / writers.JSONL_NAME)
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
  (row,) = read_jsonl(tmp_path / writers.JSONL_NAME)
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


@pytest.mark.parametrize("traced", ["step", "metric", "extra"])
def test_log_inside_jit_names_the_traced_argument_and_says_to_call_it_outside(tmp_path, traced):
  w = writers.MetricsWriter(tmp_path, tensorboard=False)

  @jax.jit
  def step_fn(x, step):
    w.log(
      step if traced == "step" else 0,
      {"x": x} if traced == "metric" else {},
      **({"loss": x} if traced == "extra" else {}),
    )
    return x

  name = {"step": "step", "metric": "metric 'x'", "extra": "metric 'loss'"}[traced]
  with pytest.raises(TypeError, match=rf"^{name} is a traced value") as e:
    step_fn(jnp.float32(1.0), jnp.int32(0))
  assert "outside jit" in str(e.value) and "jax.device_get" in str(e.value)
  w.close()
  assert (tmp_path / writers.JSONL_NAME).read_text() == ""


def test_a_negative_step_is_refused_naming_it(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    with pytest.raises(ValueError, match=r"step.*step=-3"):
      w.log(-3, {"x": 1.0})
    with pytest.raises(ValueError, match=r"step=-1"):
      w.log(np.int64(-1), {})
    assert w.log(0, {"x": 1.0})
  assert read_jsonl(tmp_path / writers.JSONL_NAME) == [{"step": 0, "x": 1.0}]


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
  (row,) = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row == {"step": 0, "run": "r", "ok": 1.0}


def test_binary_jsonl_is_read_as_malformed_lines(tmp_path):
  path = tmp_path / writers.JSONL_NAME
  path.write_bytes(bytes(range(256)) + b'\n{"step": 3}\n')
  assert read_jsonl(path) == [{"step": 3}]


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
  (row,) = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row["m"] == expected and row["loss"] == expected and type(row["m"]) is type(expected)
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  (tb,) = read_tensorboard(event_file)
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
  rows = read_jsonl(path)
  assert [(r["step"], r["loss_scale"]) for r in rows] == [(0, 2.0), (1, 8.0), (2, 16.0)]
  bad = []
  read_jsonl(path, on_bad=lambda n, why: bad.append(n))
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
  rows = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert sorted((r["run"], r["step"]) for r in rows) == sorted(
    (n, s) for n in "ab" for s in range(20)
  )
  tb = [r for f in glob.glob(str(tmp_path / "events.out.tfevents*")) for r in read_tensorboard(f)]
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
  rows = read_jsonl(path)
  assert [r["step"] for r in rows] == [0, 2]
  bad = []
  assert read_jsonl(path, on_bad=lambda n, why: bad.append((n, why))) == rows
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
def test_a_corrupt_event_record_keeps_the_records_before_it_and_says_where(tmp_path, where):
  path = _event_file(tmp_path)
  intact = read_tensorboard(path)
  data = bytearray(pathlib.Path(path).read_bytes())
  offsets = _record_offsets(data)
  # Record 0 is the file version; then loss_scale and skip_count alternate, steps 0, 1, ...
  victim = offsets[4]  # skip_count of step 1
  if where == "data":
    data[offsets[5] - 6] ^= 0x40  # a bit of its float value
  else:
    data[victim + 1] ^= 0xFF  # the record's length
  pathlib.Path(path).write_bytes(bytes(data))
  # TensorBoard's loader stops at a corrupt record: what comes before it is kept.
  expected = [intact[0], {"step": 1, "loss_scale": intact[1]["loss_scale"]}]
  assert read_tensorboard(path) == expected
  bad = []
  read_tensorboard(path, on_bad=lambda offset, why: bad.append((offset, why)))
  assert [offset for offset, _ in bad] == [victim]
  assert f"the {len(data) - victim} byte(s) from there to the end are not read" in bad[0][1]


def test_a_last_event_record_cut_short_costs_that_record_only(tmp_path):
  path = _event_file(tmp_path)
  intact = read_tensorboard(path)
  data = pathlib.Path(path).read_bytes()
  last = _record_offsets(data)[-1]
  pathlib.Path(path).write_bytes(data[:-3])  # a crash in the middle of the last write
  bad = []
  rows = read_tensorboard(path, on_bad=lambda offset, why: bad.append(offset))
  assert rows == intact[:-1] + [{"step": 5, "loss_scale": intact[-1]["loss_scale"]}]
  assert bad == [last]


def _tensorboard_writer_scalars(logdir, rows):
  """Writes ``rows`` with TensorBoard's own event-file writer, each scalar as a one-element tensor
  summary of the scalars plugin, as tf.summary.scalar and TensorBoard's summary API do."""
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.plugins.scalar import metadata
  from tensorboard.summary.writer.event_file_writer import EventFileWriter
  from tensorboard.util import tensor_util

  writer = EventFileWriter(str(logdir))
  for row in rows:
    values = [
      summary_pb2.Summary.Value(
        tag=tag,
        metadata=metadata.create_summary_metadata(display_name=tag, description=""),
        tensor=tensor_util.make_tensor_proto(np.float32(value)),
      )
      for tag, value in row.items()
      if tag != "step"
    ]
    writer.add_event(event_pb2.Event(step=row["step"], summary=summary_pb2.Summary(value=values)))
  writer.close()


@pytest.mark.parametrize("source", ["tensorboardX", "torch", "torch new_style", "tensorboard"])
def test_event_files_of_each_writer_are_read(tmp_path, source):
  rows = [{"step": s, "loss_scale": 2.0 ** (10 + s), "skip_count": float(s // 2)} for s in range(5)]
  if source == "tensorboard":
    _tensorboard_writer_scalars(tmp_path, rows)
  else:
    if source == "tensorboardX":
      from tensorboardX import SummaryWriter
    else:  # torch is not installed everywhere the tests run (no build for the newest Python)
      SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    kwargs = {"new_style": True} if source.endswith("new_style") else {}
    with SummaryWriter(str(tmp_path)) as w:
      for row in rows:
        for tag in ("loss_scale", "skip_count"):
          w.add_scalar(tag, row[tag], row["step"], **kwargs)
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  assert read_tensorboard(event_file) == rows


def test_leaf_records_are_read_from_text_summaries_and_other_text_is_ignored(tmp_path):
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.plugins.text import metadata
  from tensorboard.summary.writer.event_file_writer import EventFileWriter
  from tensorboard.util import tensor_util

  def text(tag, value):  # as tf.summary.text writes it: a 0-d string tensor
    return summary_pb2.Summary.Value(
      tag=tag,
      metadata=metadata.create_summary_metadata(display_name=tag, description=""),
      tensor=tensor_util.make_tensor_proto(np.array(value.encode(), dtype=object)),
    )

  writer = EventFileWriter(str(tmp_path))
  for step, values in enumerate(
    [
      [text("train/nonfinite_leaves", '{"a/w": "nan", "b": "inf"}')],
      [text("nonfinite_leaves", "not json"), text("notes", '{"a/w": "nan"}')],
      [text("nonfinite_leaves", '{"a/w": "big"}'), text("nonfinite_leaves/x", '["a"]')],
      [text("my_nonfinite_leaves", '{"a/w": "nan"}')],
    ]
  ):
    writer.add_event(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=values)))
  writer.close()
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  assert read_tensorboard(event_file) == [
    {"step": 0, "train/nonfinite_leaves": {"a/w": "nan", "b": "inf"}}
  ]


@pytest.mark.parametrize(
  "call",
  [
    lambda: writers.MetricsWriter(None),
    lambda: writers.MetricsWriter(3, tensorboard=False),
  ],
)
def test_paths_must_be_str_or_pathlike(call):
  with pytest.raises(TypeError, match=r"logdir must be a str or os.PathLike"):
    call()


def test_tensorboard_true_without_tensorboardx_names_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)
  install = r'pip install tensorboardX.*pip install -e "\.\[monitoring\]"'
  with pytest.raises(ImportError, match=install):
    writers.MetricsWriter(tmp_path)
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:  # the JSON lines need nothing
    assert w.log(0, {"a": 1.0})


# --- Where a step went non-finite: the packed leaf records, written as names ---


def _words(bits, words=1):
  out = np.zeros(words, np.uint32)
  for k in bits:
    out[k // 32] |= np.uint32(1 << (k % 32))
  return out


def _nonfinite_metrics(step, leaves=(), nan=(), loss=False, words=1, **extra):
  """Metrics as optax_dls.metrics gives them once non-finite steps are localised (NumPy values)."""
  return {
    "loss_scale": np.float32(2.0**10),
    "num_steps": np.int32(step + 1),
    "nonfinite_step": np.int32(step),
    "nonfinite_loss": np.bool_(loss),
    "nonfinite_leaves": _words(leaves, words),
    "nonfinite_nan": _words(nan, words),
    **extra,
  }


PARAMS = {
  "decoder": {"attn": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)}, "step": jnp.int32(0)},
  "embed": jax.ShapeDtypeStruct((8, 2), jnp.bfloat16),
}  # floating leaves in order: decoder/attn/bias, decoder/attn/kernel, embed


def test_non_finite_leaves_are_written_by_name_once_per_non_finite_step(tmp_path):
  with writers.MetricsWriter(tmp_path, params=PARAMS) as w:
    w.log(0, _nonfinite_metrics(0))  # no non-finite step yet
    w.log(1, _nonfinite_metrics(2, leaves=[1, 2], nan=[2], **{"overflows/decoder": np.int32(1)}))
    w.log(2, _nonfinite_metrics(2, leaves=[1, 2], nan=[2], **{"overflows/decoder": np.int32(1)}))
    w.log(3, _nonfinite_metrics(4, leaves=[0], loss=True, **{"overflows/decoder": np.int32(2)}))
  rows = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert [r.get("nonfinite_leaves") for r in rows] == [
    None,
    {"decoder/attn/kernel": "inf", "embed": "nan"},
    None,  # the same non-finite step as the row before
    {"decoder/attn/bias": "inf"},
  ]
  assert [(r["nonfinite_step"], r["nonfinite_loss"]) for r in rows] == [
    (0, False),
    (2, False),
    (2, False),
    (4, True),
  ]
  assert "nonfinite_nan" not in rows[1] and rows[3]["overflows/decoder"] == 2
  (event_file,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  tb = read_tensorboard(event_file)
  assert [r["nonfinite_leaf_count"] for r in tb] == [0, 2, 2, 1]
  assert [r["nonfinite_loss"] for r in tb] == [0, 0, 0, 1]
  assert tb[3]["overflows/decoder"] == 2 and tb[1]["nonfinite_step"] == 2
  # The names travel as a text summary, read back as the JSON rows hold them.
  assert [r.get("nonfinite_leaves") for r in tb] == [r.get("nonfinite_leaves") for r in rows]
  assert not any("nonfinite_nan" in r for r in tb)


def test_the_first_row_of_a_writer_names_the_last_non_finite_step(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False, params=["a", "b"]) as w:
    w.log(10, _nonfinite_metrics(7, leaves=[1]))  # e.g. a resumed run
  (row,) = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row["nonfinite_leaves"] == {"b": "inf"}


def test_without_params_the_leaves_are_numbered(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.log(0, _nonfinite_metrics(1, leaves=[3, 40], nan=[40], words=2))
  (row,) = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row["nonfinite_leaves"] == {"leaf 3": "inf", "leaf 40": "nan"}


def test_every_k_steps_records_the_last_non_finite_step_before_each_logged_row(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False, every=5, params=["a", "b"]) as w:
    for step, (nonfinite, leaf) in enumerate([(0, 0)] * 3 + [(4, 0), (5, 1)] * 4):
      w.log(step, _nonfinite_metrics(nonfinite, leaves=[leaf] if nonfinite else []))
  rows = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert [(r["step"], r.get("nonfinite_leaves")) for r in rows] == [
    (0, None),
    (5, {"a": "inf"}),  # step 5 logs nonfinite_step 4
    (10, {"b": "inf"}),  # step 10 logs nonfinite_step 5: 4 in between is not recorded again
  ]


def test_the_record_from_a_real_optimizer_state_is_named(tmp_path):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0)
  params = {"b": jnp.zeros(2), "n": jnp.zeros(2), "step": jnp.int32(0), "w": jnp.zeros(2)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  for b, n in [(1.0, 1.0), (jnp.inf, 1.0), (1.0, 1.0), (-jnp.inf, jnp.nan)]:
    grads = {"b": jnp.full(2, b), "n": jnp.array([1.0, n]), "step": None, "w": jnp.ones(2)}
    _, state = update(grads, state, params)
    with writers.MetricsWriter(tmp_path, tensorboard=False, params=params) as w:
      w.log(0, optax_dls.metrics(state))
  rows = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert [r.get("nonfinite_leaves") for r in rows] == [
    None,
    {"b": "inf"},
    {"b": "inf"},  # a new writer names the last non-finite step again
    {"b": "inf", "n": "nan"},
  ]
  assert [r["nonfinite_step"] for r in rows] == [0, 2, 2, 4]
  assert rows[3]["nonfinite_leaves"] == optax_dls.nonfinite_leaves(state, params)


@pytest.mark.parametrize(
  "metrics, match",
  [
    ({"nonfinite_leaves": _words([0]), "nonfinite_step": 1}, "without.*nonfinite_nan"),
    ({"nonfinite_leaves": _words([0]), "nonfinite_nan": _words([])}, "without.*nonfinite_step"),
    (
      {"nonfinite_leaves": _words([0], 2), "nonfinite_nan": _words([]), "nonfinite_step": 1},
      "differ in shape",
    ),
    (
      {"nonfinite_leaves": _words([0], 2), "nonfinite_nan": _words([], 2), "nonfinite_step": 1},
      "3 floating leaves.*made for 33 to 64 leaves",
    ),
    (
      {"nonfinite_leaves": np.ones(1), "nonfinite_nan": _words([]), "nonfinite_step": 1},
      "'nonfinite_leaves' must be the uint32 array optax_dls.metrics returns",
    ),
    ({"nonfinite_count": _words([0])}, "'nonfinite_count' must be a scalar"),
  ],
)
def test_a_malformed_non_finite_record_is_refused_naming_what_is_wrong(tmp_path, metrics, match):
  with (
    writers.MetricsWriter(tmp_path, tensorboard=False, params=PARAMS) as w,
    pytest.raises(ValueError, match=match),
  ):
    w.log(0, metrics)


@pytest.mark.parametrize("params", [{"a": "text"}, object(), 3, [1, 2], {"step": jnp.int32(0)}])
def test_params_that_are_not_parameters_nor_names_raise_type_error(tmp_path, params):
  with pytest.raises(TypeError, match="params must be a pytree"):
    writers.MetricsWriter(tmp_path, tensorboard=False, params=params)
