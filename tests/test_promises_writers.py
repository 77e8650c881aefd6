"""The promises of the ``optax_dls.writers`` docstrings not held elsewhere."""

from __future__ import annotations

import glob
import json
import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from _logs_read import read_jsonl, read_tensorboard

from optax_dls import writers


class _Report:
  def __init__(self, first):
    self.first = first

  def to_dict(self):
    return {"first": self.first}


def test_non_finite_values_stay_in_the_json_lines_and_event_rows_come_sorted_by_step(tmp_path):
  with writers.MetricsWriter(tmp_path, every=2) as w:
    w.log(4, {"grad_norm": jnp.float32(jnp.inf), "x": 1.0})
    w.log(np.int32(2), {"grad_norm": jnp.float32(3.0), "x": 2.0})
  text = (tmp_path / writers.JSONL_NAME).read_text()
  assert '"grad_norm": Infinity' in text
  (events,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  assert re.search(rf"\.{os.getpid()}\.[0-9a-f]{{12}}$", events)  # this writer's own file
  assert read_tensorboard(events) == [
    {"step": 2, "grad_norm": 3.0, "x": 2.0},
    {"step": 4, "x": 1.0},
  ]


def test_a_resumed_writer_appends_and_blank_lines_are_ignored(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.log(0, {"x": 1.0})
  with (tmp_path / writers.JSONL_NAME).open("a") as f:
    f.write("\n   \n")
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.log(1, {"x": 2.0})
  bad = []
  rows = read_jsonl(tmp_path / writers.JSONL_NAME, on_bad=lambda *a: bad.append(a))
  assert rows == [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}] and bad == []


@pytest.mark.parametrize("every", [np.int64(3), jnp.asarray(3), np.asarray(3, np.int8)])
def test_every_takes_numpy_integers_and_0d_integer_arrays(tmp_path, every):
  with writers.MetricsWriter(tmp_path, every=every, tensorboard=False) as w:
    assert [w.log(s, {"x": 1.0}) for s in range(4)] == [True, False, False, True]
  with pytest.raises(TypeError, match="every"):
    writers.MetricsWriter(tmp_path, every=3.0, tensorboard=False)


def test_write_locate_replaces_an_earlier_report_and_needs_an_int_step(tmp_path):
  with writers.MetricsWriter(tmp_path, tensorboard=False) as w:
    w.write_locate(_Report("a"), step=1)
    path = w.write_locate(_Report("b"))
    with pytest.raises(TypeError, match="step"):
      w.write_locate(_Report("c"), step=1.5)
  assert path == str(tmp_path / writers.LOCATE_NAME)
  assert json.loads((tmp_path / writers.LOCATE_NAME).read_text()) == {"first": "b"}


def test_tensorboard_leaves_strings_and_none_out_of_the_events(tmp_path):
  with writers.MetricsWriter(tmp_path) as w:
    w.log(0, {"note": "text", "missing": None, "big": 10**400, "x": float("nan"), "y": 2})
  (events,) = glob.glob(str(tmp_path / "events.out.tfevents*"))
  assert read_tensorboard(events) == [{"step": 0, "y": 2.0}]
  (row,) = read_jsonl(tmp_path / writers.JSONL_NAME)
  assert row["note"] == "text" and row["missing"] is None and row["big"] == 10**400
  assert math.isnan(row["x"])


def test_a_record_that_is_not_an_event_costs_that_record_only(tmp_path):
  pytest.importorskip("tensorboard")
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.summary.writer.record_writer import RecordWriter

  def event(step, value):
    value = summary_pb2.Summary.Value(tag="x", simple_value=value)
    return event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))

  path = tmp_path / "events.out.tfevents.1"
  with path.open("wb") as f:  # records with good checksums; the middle one holds no Event
    records = RecordWriter(f)
    for data in (
      event(0, 1.0).SerializeToString(),
      b"\xff\xff not an event",
      event(1, 2.0).SerializeToString(),
    ):
      records.write(data)
  bad = []
  rows = read_tensorboard(path, on_bad=lambda offset, why: bad.append(offset))
  assert rows == [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
  assert bad == [16 + len(event(0, 1.0).SerializeToString())]  # the second record starts there
