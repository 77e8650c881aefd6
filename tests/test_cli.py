"""optax-dls inspect: summary, diagnosis and plot from JSONL / TensorBoard logs."""

import json
import os
import re
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _logs_read import read_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optax_dls
from optax_dls import cli, writers
from optax_dls._logs.diagnosis import NO_GROWTH_UPDATES, ZERO_RISE
from optax_dls._logs.report import inspect as _inspect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_lm.py")


def _inspect_json(path, capsys, *extra):
  assert cli.main(["inspect", str(path), "--json", *extra]) == 0
  return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A real tiny fp16 training loop with overflowing batches at known steps, logged by
  MetricsWriter."""
  out = tmp_path_factory.mktemp("run")
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**8, growth_interval=4)
  params = {"w": jnp.zeros((4,), jnp.float32)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    def loss_fn(p):
      pred = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
      loss = jnp.mean(jnp.square(pred - 1.0).astype(jnp.float32))
      return optax_dls.scale_loss(loss, state), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  bad = {5, 6, 7, 20}
  scales, skipped = [], []
  with writers.MetricsWriter(out, every=1, run_name="tiny", params=params) as w:
    for i in range(30):
      x = jnp.full((2, 4), 1e4 if i in bad else 0.5)
      params, state, loss = step(params, state, x)
      m = optax_dls.metrics(state)
      w.log(i, m, loss=loss)
      scales.append(float(m["loss_scale"]))
      skipped.append(bool(m["skipped"]))
  return out, np.array(scales), np.array(skipped)


def test_summary_matches_the_training_loop(trained, capsys, tmp_path):
  out, scales, skipped = trained
  png = tmp_path / "plot.png"
  report = _inspect_json(out, capsys, "--plot", str(png))
  s = report["tiny"]["summary"]
  assert skipped.sum() == 4
  assert s["updates"] == 30 and s["skips"] == int(skipped.sum())
  assert s["update_ratio"] == pytest.approx(1 - skipped.mean())
  assert s["longest_skip_streak"] == 3
  assert (s["scale_min"], s["scale_median"], s["scale_max"]) == (
    scales.min(),
    np.sort(scales)[(len(scales) - 1) // 2],  # the lower median: a logged value
    scales.max(),
  )
  assert s["steps_at_min_scale"] == int((scales == scales.min()).sum())
  assert s["steps_at_max_scale"] == int((scales == scales.max()).sum())
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_output_and_tensorboard_only_folder(trained, capsys, tmp_path):
  out, _, _ = trained
  assert cli.main(["inspect", str(out)]) == 0
  text = capsys.readouterr().out
  assert "run tiny" in text and "longest streak 3" in text
  assert "non-finite steps by parameter (the 4 the logs record):\n    w  4 of 4 (inf)" in text
  # The same run read back from its TensorBoard events only: the same summary, leaf names
  # included (a text summary beside the scalars).
  tb_dir = tmp_path / "tb"
  tb_dir.mkdir()
  for name in os.listdir(out):
    if name.startswith("events.out.tfevents"):
      os.link(out / name, tb_dir / name)
  from_tb = _inspect_json(tb_dir, capsys)["tb"]["summary"]
  from_jsonl = _inspect_json(out, capsys)["tiny"]["summary"]
  named = from_jsonl["nonfinite"]
  assert named["steps_seen"] == named["steps_with_leaves"] == 4
  assert named["by_parameter"] == [{"name": "w", "steps": 4, "inf": 4, "nan": 0}]
  assert from_tb == from_jsonl
  assert cli.main(["inspect", str(tb_dir)]) == 0
  assert "non-finite steps by parameter (the 4 the logs record):\n    w  4 of 4 (inf)" in (
    capsys.readouterr().out
  )


def test_folder_without_logs_exits_2(tmp_path, capsys):
  (tmp_path / "notes.txt").write_text("nothing here")
  assert cli.main(["inspect", str(tmp_path)]) == 2
  assert "no metrics logs" in capsys.readouterr().err
  assert cli.main(["inspect", str(tmp_path / "missing")]) == 2


def _write(path, rows):
  with writers.MetricsWriter(path, tensorboard=False) as w:
    for i, r in enumerate(rows):
      w.log(i, r)


def _row(i, scale=2.0**15, skipped=False, skips=0, loss=1.0, **extra):
  return {
    "loss_scale": scale,
    "skipped": skipped,
    "skip_count": skips,
    "num_steps": i + 1,
    "consecutive_skips": int(skipped),
    "loss": loss,
    **extra,
  }


def _healthy(i):
  return _row(i, scale=2.0 ** (10 + i // 50), loss=2.0 - i / 400)


SYMPTOMS = {
  "frequent overflow": lambda i: _row(i, 2.0**10, i % 5 == 0, i // 5 + 1, 2 - i / 400),
  "scale never grows": lambda i: _row(i, 2.0**12, loss=2 - i / 2000),
  "gradients lost to underflow": lambda i: (
    _healthy(i) | {"underflow/subnormal_frac": 0.2, "underflow/zero_frac": 0.05 + 0.5 * i / 200}
  ),
  "stuck at the minimum": lambda i: _row(
    i, 1.0 if i > 100 else 2.0**12, i > 100, max(i - 100, 0), 2 - i / 400
  ),
  "diverging loss": lambda i: _row(i, 2.0 ** (10 + i // 50), loss=1.0 + i / 20),
}


@pytest.mark.parametrize("symptom", sorted(SYMPTOMS))
def test_diagnoses_each_symptom_and_only_it(symptom, tmp_path, capsys):
  n = 1200 if symptom == "scale never grows" else 200
  _write(tmp_path, [SYMPTOMS[symptom](i) for i in range(n)])
  found = [d["symptom"] for d in _inspect_json(tmp_path, capsys)[tmp_path.name]["diagnosis"]]
  assert any(f.startswith(symptom) for f in found), found
  assert len(found) == 1, found


def test_one_overflow_per_growth_is_probing_not_frequent_overflow(tmp_path, capsys):
  # Grow every 10 steps, overflow right after, back off: dynamic scaling's steady state.
  _write(
    tmp_path,
    [
      _row(i, 2.0 ** (10 + (i % 10 == 9)), i % 10 == 0, i // 10 + 1, 2 - i / 400)
      for i in range(200)
    ],
  )
  assert _inspect_json(tmp_path, capsys)[tmp_path.name]["diagnosis"] == []


def test_healthy_run_has_no_diagnosis(tmp_path, capsys):
  _write(tmp_path, [_healthy(i) for i in range(200)])
  report = _inspect_json(tmp_path, capsys)[tmp_path.name]
  assert report["diagnosis"] == [] and report["summary"]["scale_increases"] == 3


def test_a_scale_held_by_recomputed_overflows_is_not_pinned(tmp_path, capsys):
  pinned = tmp_path / "pinned"
  _write(pinned, [_row(i, 2.0**24) for i in range(200)])
  found = [d["symptom"] for d in _inspect_json(pinned, capsys)["pinned"]["diagnosis"]]
  assert len(found) == 1 and found[0].startswith("scale pinned"), found
  # The same scale, held there by overflows that were recomputed instead of skipped.
  held = tmp_path / "held"
  _write(
    held,
    [
      _row(i, 2.0**24, recompute_tries=(i + 5) // 20, recomputed_steps=(i + 5) // 20)
      for i in range(200)
    ],
  )
  assert _inspect_json(held, capsys)["held"]["diagnosis"] == []


@pytest.mark.skipif(not os.path.exists(EXAMPLE), reason="examples/train_lm.py not present")
def test_inspect_logs_of_the_main_example(tmp_path, capsys):
  sys.path.insert(0, os.path.dirname(EXAMPLE))
  import train_lm

  out = tmp_path / "example"
  flags = [
    "--runs",
    "fp16-dls",
    "--steps",
    "4",
    "--batch-size",
    "2",
    "--seq-len",
    "8",
    "--d-model",
    "8",
    "--layers",
    "1",
    "--heads",
    "1",
    "--eval-every",
    "4",
    "--eval-batches",
    "1",
    "--out",
    str(out),
  ]
  assert train_lm.main(flags) == 0
  capsys.readouterr()
  s = _inspect_json(out, capsys)["fp16-dls"]["summary"]
  rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss_scale" in r]
  assert s["updates"] == 4 == len(rows)
  assert s["skips"] == max(r["skip_count"] for r in rows)
  assert s["scale_max"] == max(r["loss_scale"] for r in rows)


def _write_log(path, text, mode="w"):
  path.mkdir(parents=True, exist_ok=True)
  with open(path / "metrics.jsonl", mode) as f:
    f.write(text)


@pytest.mark.parametrize(
  "bad", ['"abc"', "null", "NaN", "1.5", "1e400", "Infinity", "true", str(10**30)]
)
def test_rows_with_a_malformed_step_are_skipped_with_a_warning(bad, tmp_path, capsys):
  _write_log(
    tmp_path,
    f'{{"step": 0, "loss_scale": 1024}}\n{{"step": {bad}, "loss_scale": 2}}\n'
    f'{{"step": 1, "loss_scale": 512, "num_steps": Infinity, "skip_count": {10**400}}}\n',
  )
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  captured = capsys.readouterr()
  (summary,) = [r["summary"] for r in json.loads(captured.out).values()]
  assert (summary["logged_steps"], summary["scale_min"], summary["scale_max"]) == (2, 512, 1024)
  assert "skipped 1 row(s)" in captured.err


@pytest.mark.parametrize(
  "content",
  [
    b'{"step": "a"}\n{"step": null}\n',
    bytes(range(256)) * 2,
    b'{"step": 0, "loss_scale": 1024\n{garbage\n',
  ],
)
def test_all_corrupt_logs_exit_2_saying_they_are_unreadable(content, tmp_path, capsys):
  tmp_path.joinpath("metrics.jsonl").write_bytes(content)
  assert cli.main(["inspect", str(tmp_path)]) == 2
  assert "exist but are unreadable" in capsys.readouterr().err


def test_corrupt_event_file_exits_2(tmp_path, capsys):
  tmp_path.joinpath("events.out.tfevents.1").write_bytes(b"\x05" + bytes(range(256)) * 2)
  assert cli.main(["inspect", str(tmp_path)]) == 2
  assert "exist but are unreadable" in capsys.readouterr().err


@pytest.mark.parametrize(
  "argv, message",
  [
    (["nope"], "invalid choice: 'nope'"),
    ([], "the following arguments are required"),
    (["inspect"], "the following arguments are required: run_dir"),
    (["inspect", "run", "--colour"], "unrecognized arguments: --colour"),
  ],
)
def test_usage_errors_return_2_with_argparses_message(argv, message, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "usage: optax-dls" in err and message in err


def test_help_returns_0(capsys):
  assert cli.main(["--help"]) == 0
  assert "inspect" in capsys.readouterr().out


@pytest.mark.parametrize(
  "plot, message", [("missing/out.png", "does not exist"), ("out.xyz", "extension")]
)
def test_bad_plot_path_is_an_argument_error(plot, message, tmp_path, capsys):
  _write_log(tmp_path / "run", '{"step": 0, "loss_scale": 1}\n')
  assert cli.main(["inspect", str(tmp_path / "run"), "--plot", str(tmp_path / plot)]) == 2
  err = capsys.readouterr().err
  assert "--plot" in err and message in err


# --- Logs written every k steps: a stream simulated with the dynamic rule (x2 growth, x1/2 backoff)


class _Stream(NamedTuple):
  rows: list  # the metrics after each update, as optax_dls.metrics gives them, plus the loss
  used: np.ndarray  # the scale each update ran at
  skipped: np.ndarray
  grew: np.ndarray  # whether the update raised the scale


def _simulate(
  n,
  *,
  growth_interval=10,
  ceiling=2.0**10,
  init=2.0**16,
  hysteresis=1,
  min_scale=1.0,
  max_scale=2.0**24,
  spikes=(),
  nonfinite_from=None,
  loss=None,
  nan_loss_when_skipped=False,
  underflow=None,
  finite_drops=(),
  growth_at=(),
):
  """``n`` updates of dynamic loss scaling: an update overflows when its scale exceeds
  ``ceiling(t)``, at the steps in ``spikes`` and from ``nonfinite_from`` on. At the steps in
  ``finite_drops`` a finite update halves the scale, as amax_policy does when the gradients grow;
  at the steps in ``growth_at`` a finite update doubles it, whatever the growth interval."""
  ceiling = ceiling if callable(ceiling) else (lambda t, c=ceiling: c)
  loss = loss or (lambda t: 2.0 - t / 4000)
  scale, tracker, skips, consec = init, 0, 0, 0
  rows, used, skipped, grew = [], [], [], []
  for t in range(n):
    before = scale
    over = scale > ceiling(t) or t in spikes or (nonfinite_from is not None and t >= nonfinite_from)
    consec, tracker = (consec + 1, 0) if over else (0, tracker + 1)
    if over and consec >= hysteresis:
      scale = max(scale / 2, min_scale)
    elif not over and (tracker >= growth_interval or t in growth_at):
      scale, tracker = min(scale * 2, max_scale), 0
    elif not over and t in finite_drops:
      scale = max(scale / 2, min_scale)
    skips += over
    row = {
      "loss_scale": scale,
      "skipped": over,
      "skip_count": skips,
      "consecutive_skips": consec,
      "num_steps": t + 1,
      "update_ratio": (t + 1 - skips) / (t + 1),
      "grad_norm": 1.0,
      "loss": float("nan") if over and nan_loss_when_skipped else loss(t),
    }
    if underflow is not None:  # (subnormal share, zero share at the start, zero share at the end)
      sub, zero0, zero1 = underflow
      row["underflow/subnormal_frac"], row["underflow/zero_frac"] = (
        sub,
        zero0 + (zero1 - zero0) * t / n,
      )
    rows.append(row)
    used.append(before)
    skipped.append(over)
    grew.append(scale > before)
  return _Stream(rows, np.array(used), np.array(skipped), np.array(grew))


def _log(path, rows, every=1, source="jsonl", drop=()):
  with writers.MetricsWriter(
    path, every=every, tensorboard=source == "tensorboard", jsonl=source == "jsonl"
  ) as w:
    for step, row in enumerate(rows):
      w.log(step, {k: v for k, v in row.items() if k not in drop})


def _diagnosis(path, capsys):
  (report,) = _inspect_json(path, capsys).values()
  return [d["symptom"] for d in report["diagnosis"]]


@pytest.mark.parametrize("every", [1, 10, 100])
@pytest.mark.parametrize("growth_interval", [2, 10, 50, 1000])
def test_probing_is_not_frequent_overflow_whatever_the_logging_interval(
  tmp_path, capsys, every, growth_interval
):
  # A healthy run: the scale grows after growth_interval clean steps, overflows once, backs off.
  stream = _simulate(3000, growth_interval=growth_interval)
  assert stream.skipped[100:].sum() >= 2  # it does probe
  _log(tmp_path, stream.rows, every)
  assert _diagnosis(tmp_path, capsys) == []


@pytest.mark.parametrize("every", [10, 100])
def test_tensorboard_logs_every_k_steps_give_the_jsonl_diagnosis(tmp_path, capsys, every):
  stream = _simulate(3000, growth_interval=10)
  _log(tmp_path / "tb", stream.rows, every, source="tensorboard")
  _log(tmp_path / "js", stream.rows, every)
  from_tb, from_js = (_inspect_json(tmp_path / d, capsys)[d] for d in ("tb", "js"))
  assert from_tb == from_js and from_tb["diagnosis"] == []


REAL_SYMPTOMS = {
  # Overflow spikes every 50 updates, each halving the scale, and no growth to undo them.
  "frequent overflow": lambda: _simulate(
    900, growth_interval=10**6, init=2.0**24, ceiling=2.0**30, spikes=set(range(25, 900, 50))
  ),
  "scale never grows": lambda: _simulate(1200, growth_interval=10**6, init=2.0**12),
  "gradients lost to underflow": lambda: _simulate(1200, underflow=(0.2, 0.05, 0.5)),
  "stuck at the minimum": lambda: _simulate(
    400, init=2.0**12, ceiling=2.0**20, nonfinite_from=100, nan_loss_when_skipped=True
  ),
  "diverging loss": lambda: _simulate(2500, loss=lambda t: 1.0 + t / 200),
}


@pytest.mark.parametrize("every", [1, 10, 100])
@pytest.mark.parametrize("symptom", sorted(REAL_SYMPTOMS))
def test_each_symptom_is_found_at_every_logging_interval_and_only_it(
  tmp_path, capsys, symptom, every
):
  _log(tmp_path, REAL_SYMPTOMS[symptom]().rows, every)
  found = _diagnosis(tmp_path, capsys)
  assert len(found) == 1 and found[0].startswith(symptom), found


@pytest.mark.parametrize("every", [1, 10])
def test_a_scale_that_also_drops_on_finite_steps_is_not_read_as_overflow(tmp_path, capsys, every):
  # Every 20 updates: a growth, its probe overflow, then two drops on finite steps (as amax_policy
  # does), so the scale falls two octaves per cycle while every skip follows a growth.
  cycles = range(0, 400, 20)
  stream = _simulate(
    400,
    growth_interval=10**6,
    init=2.0**50,
    ceiling=2.0**60,
    max_scale=2.0**60,
    spikes={t + 1 for t in cycles},
    finite_drops={t + d for t in cycles for d in (2, 12)},
    growth_at={t for t in cycles},
  )
  assert stream.skipped.sum() == 20 and stream.grew[list(cycles)].all()
  _log(tmp_path, stream.rows, every)
  assert _diagnosis(tmp_path, capsys) == []


@pytest.mark.parametrize("every", [1, 10])
def test_a_run_without_a_loss_column_has_no_loss_diagnosis(tmp_path, capsys, every):
  _log(tmp_path, _simulate(500, growth_interval=50).rows, every, drop=("loss",))
  assert _diagnosis(tmp_path, capsys) == []


def test_non_finite_loss_of_skipped_steps_is_not_divergence(tmp_path, capsys):
  stream = _simulate(2000, growth_interval=20, nan_loss_when_skipped=True)
  _log(tmp_path, stream.rows, 1, drop=("skipped", "consecutive_skips"))
  assert _diagnosis(tmp_path, capsys) == []


def test_without_counters_nothing_unprovable_is_reported(tmp_path, capsys):
  # Only the scale and the loss: skips and updates are unknown, and so is every diagnosis resting
  # on them.
  stream = _simulate(3000, growth_interval=10)
  _log(
    tmp_path,
    stream.rows,
    10,
    drop=("skipped", "skip_count", "consecutive_skips", "num_steps", "update_ratio"),
  )
  (report,) = _inspect_json(tmp_path, capsys).values()
  assert report["diagnosis"] == []
  assert report["summary"]["skips"] is None and report["summary"]["longest_skip_streak"] is None
  assert report["summary"]["updates"] == 2991  # steps 0..2990 logged: one update per step
  assert cli.main(["inspect", str(tmp_path)]) == 0
  assert "skips        unknown" in capsys.readouterr().out


def test_skips_come_from_update_ratio_without_skip_count(tmp_path, capsys):
  stream = _simulate(3000, growth_interval=10)
  _log(tmp_path, stream.rows, 10, drop=("skip_count",))
  summary = _inspect_json(tmp_path, capsys)[tmp_path.name]["summary"]
  assert summary["skips"] == stream.rows[2990]["skip_count"] and summary["updates"] == 2991


def test_text_names_the_lowest_and_highest_logged_scale_as_powers_of_two(tmp_path, capsys):
  _write(
    tmp_path, [_row(i, scale=2.0 ** (21 - (i % 3))) for i in range(5)]
  )  # 2^21, 2^20, 2^19, 2^21, 2^20
  assert cli.main(["inspect", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  assert "lowest 2^19 / median 2^20 / highest 2^21 (logged)" in text
  assert "2.09715e+06" not in text and "at min scale" not in text and "at max scale" not in text
  assert "at the lowest scale 1 logged step, at the highest 2 logged steps" in text


def test_a_closed_pipe_ends_quietly(tmp_path):
  for i in range(300):  # a report longer than the pipe buffer
    _write_log(
      tmp_path / f"run{i:03d}", '{"step": 0, "loss_scale": 1024, "num_steps": 1, "skip_count": 0}\n'
    )
  proc = subprocess.Popen(
    [sys.executable, "-m", "optax_dls.cli", "inspect", str(tmp_path)],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )
  proc.stdout.close()  # as `| head -1` does once it has its line
  err = proc.stderr.read().decode()
  assert proc.wait() == 1
  assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_skipped_lines_are_counted_on_stderr_and_cost_only_themselves(tmp_path, capsys):
  good = [
    json.dumps({"step": i, "loss_scale": 2.0**10, "num_steps": i + 1, "skip_count": 0})
    for i in range(5)
  ]
  lines = [
    good[0],
    "garbage",
    good[1],
    '{"step": 2, "loss_scale": ' + "9" * 5000 + "}",
    good[2],
    "[" * 100000,
    good[3],
    '{"no step": 1}',
    good[4],
    '{"step": 5, "loss_sc',
  ]  # the last cut short
  _write_log(tmp_path, "\n".join(lines))
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out)[tmp_path.name]["summary"]["logged_steps"] == 5
  assert (
    "skipped 5 line(s) that are not JSON objects with a 'step' (line 2, 4, 6, 8, 10)"
    in captured.err
  )


def test_a_corrupt_event_record_keeps_the_steps_before_it_in_inspect_and_says_where(
  tmp_path, capsys
):
  stream = _simulate(40, growth_interval=5)
  _log(tmp_path, stream.rows, source="tensorboard")
  (path,) = tmp_path.glob("events.out.tfevents*")
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  captured = capsys.readouterr()
  summary = json.loads(captured.out)[tmp_path.name]["summary"]
  assert 18 <= summary["logged_steps"] <= 20 and summary["last_step"] < 20
  assert re.search(r"at byte \d+: a corrupt or cut-short record: the \d+ byte\(s\)", captured.err)


def test_a_step_logged_again_after_a_restart_is_merged(tmp_path, capsys):
  stream = _simulate(300, growth_interval=10)
  _log(tmp_path, stream.rows[:200])
  with writers.MetricsWriter(
    tmp_path, tensorboard=False
  ) as w:  # resumed from the checkpoint of step 149
    for step in range(150, 300):
      w.log(step, stream.rows[step])
  report = _inspect_json(tmp_path, capsys)[tmp_path.name]
  assert report["summary"]["logged_steps"] == 300 and report["diagnosis"] == []
  assert report["summary"]["skips"] == stream.rows[-1]["skip_count"]


# --- Property: inspect reports only problems the metric stream holds ---


def _true_excess_skips(stream, first, last):
  """Skips at updates first+1..last with no growth since the previous skip (not a probe)."""
  excess, grown = 0, False
  for t in range(last + 1):
    if stream.skipped[t]:
      excess += first < t and not grown
      grown = False
    grown = grown or stream.grew[t]
  return excess


def _check_claim(symptom, stream, kind):
  """Asserts that what ``symptom`` says holds in the full, per-update ``stream``."""
  if m := re.match(
    r"frequent overflow: at least (\d+) of the (\d+) updates from step (\d+) to step (\d+)", symptom
  ):
    count, updates, first, last = map(int, m.groups())
    assert updates == last - first and 0 < count <= _true_excess_skips(stream, first, last)
  elif m := re.match(
    r"scale never grows: no increase in the (\d+) updates from step (\d+) to step (\d+)", symptom
  ):
    span, first, last = map(int, m.groups())
    assert span == last - first >= NO_GROWTH_UPDATES and not stream.grew[first + 1 : last + 1].any()
  elif m := re.match(
    r"stuck at the minimum: at least (\d+) updates were skipped with the loss scale at or "
    r"below 1",
    symptom,
  ):
    assert int(m.group(1)) <= (stream.skipped & (stream.used <= 1.0)).sum()
  elif m := re.match(
    r"gradients lost to underflow: the share of exactly-zero gradient entries rose from "
    r"([\d.]+)% .* to a median ([\d.]+)%",
    symptom,
  ):
    early, late = (float(x) / 100 for x in m.groups())
    _, zero0, zero1 = kind["underflow"]
    assert zero1 - zero0 >= ZERO_RISE and zero0 - 0.01 <= early < late <= zero1 + 0.01
  elif symptom.startswith("scale pinned"):
    assert not stream.skipped.any()
  elif symptom.startswith("diverging loss: the mean loss of the applied steps rose"):
    assert kind["loss"] == "rising"
  else:
    raise AssertionError(f"unexpected diagnosis {symptom!r}")


_COLUMNS = (
  "loss_scale",
  "skipped",
  "skip_count",
  "consecutive_skips",
  "num_steps",
  "update_ratio",
  "loss",
  "grad_norm",
  "underflow/subnormal_frac",
  "underflow/zero_frac",
)


@st.composite
def _streams(draw):
  n = draw(st.integers(20, 2500))
  kind = {
    "every": draw(st.sampled_from([1, 2, 10, 37, 100])),
    "source": draw(st.sampled_from(["jsonl", "jsonl", "tensorboard"])),
    "drop": draw(st.sets(st.sampled_from(_COLUMNS), max_size=4)),
    "cut": draw(st.integers(0, 300)),  # bytes cut off the end of the JSONL file
    "resume": draw(st.one_of(st.none(), st.integers(0, n - 1))),
    "loss": draw(st.sampled_from(["falling", "rising"])),
    "underflow": draw(
      st.sampled_from(
        [None, (0.001, 0.05, 0.05), (0.3, 0.5, 0.5), (0.2, 0.05, 0.6), (0.2, 0.3, 0.35)]
      )
    ),
  }
  ceiling_low, ceiling_high = sorted(draw(st.lists(st.integers(-3, 24), min_size=2, max_size=2)))
  switch = draw(st.integers(0, n))
  spikes = draw(st.sampled_from([0.0, 0.002, 0.03, 0.3]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  stream = _simulate(
    n,
    growth_interval=draw(st.sampled_from([1, 2, 10, 100, 1000, 10**6])),
    # A policy starts within its range: init_scale >= min_scale.
    init=max(
      2.0 ** draw(st.integers(-2, 24)), min_scale := draw(st.sampled_from([2.0**-10, 1.0, 8.0]))
    ),
    hysteresis=draw(st.sampled_from([1, 2])),
    min_scale=min_scale,
    ceiling=lambda t: 2.0 ** (ceiling_high if t < switch else ceiling_low),
    spikes=set(np.flatnonzero(rng.random(n) < spikes).tolist()),
    nonfinite_from=draw(st.one_of(st.none(), st.integers(0, n))),
    loss=(lambda t: 2.0 - t / n + 0.05 * np.sin(t))
    if kind["loss"] == "falling"
    else (lambda t: 1.0 + t / 50),
    nan_loss_when_skipped=draw(st.booleans()),
    underflow=kind["underflow"],
  )
  return stream, kind


@settings(
  max_examples=60,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_streams())
def test_inspect_never_reports_a_problem_the_stream_does_not_hold(case, tmp_path_factory, capsys):
  stream, kind = case
  path = tmp_path_factory.mktemp("stream")
  _log(path, stream.rows, kind["every"], kind["source"], kind["drop"])
  jsonl = path / writers.JSONL_NAME
  if kind["source"] == "jsonl":
    jsonl.write_bytes(jsonl.read_bytes()[: -kind["cut"] or None])  # a crash mid-write
    if kind["resume"] is not None:  # a restart from an earlier checkpoint logs some steps again
      with writers.MetricsWriter(path, every=kind["every"], tensorboard=False) as w:
        for step in range(kind["resume"], len(stream.rows)):
          w.log(step, {k: v for k, v in stream.rows[step].items() if k not in kind["drop"]})
  if cli.main(["inspect", str(path), "--json"]) == 2:  # every row was cut off
    capsys.readouterr()
    return
  (report,) = json.loads(capsys.readouterr().out).values()
  for d in report["diagnosis"]:
    _check_claim(d["symptom"], stream, kind)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"run_dir": None}, "run_dir"),
    ({"run_dir": 3}, "run_dir"),
  ],
)
def test_inspect_names_a_wrong_argument(kwargs, match):
  with pytest.raises(TypeError, match=match):
    _inspect(**kwargs)


def test_lost_gradients_are_found_against_a_run_logged_beside_it(tmp_path, capsys):
  # The zero share of the unscaled fp16 run is high from the first step: no rise within the run,
  # but the fp32 and loss-scaled runs beside it show the floor of the same model and data.
  for name, zero in (("fp32", 0.05), ("fp16", 0.45), ("fp16-dls", 0.051)):
    scale = 1.0 if name != "fp16-dls" else 2.0**15
    _write(
      tmp_path / name,
      [_row(i, scale, loss=2 - i / 400, **{"underflow/zero_frac": zero}) for i in range(50)],
    )
  report = _inspect_json(tmp_path, capsys)
  assert [d["symptom"] for d in report["fp32"]["diagnosis"]] == []
  assert [d["symptom"] for d in report["fp16-dls"]["diagnosis"]] == []
  (found,) = report["fp16"]["diagnosis"]
  assert found["symptom"].startswith("gradients lost to underflow: a median 45.0%")
  assert "'fp32'" in found["symptom"] and found["symptom"].endswith("with no loss scaling")
  assert "dynamic_loss_scale" in found["advice"]


def test_a_high_subnormal_share_of_a_loss_scaled_run_is_not_a_problem(tmp_path, capsys):
  # Unscaled gradients below float16's normal range are what loss scaling lifts.
  _write(
    tmp_path,
    [
      _healthy(i) | {"underflow/subnormal_frac": 0.4, "underflow/zero_frac": 0.05}
      for i in range(200)
    ],
  )
  assert _inspect_json(tmp_path, capsys)[tmp_path.name]["diagnosis"] == []


# --- Defects found by a new user ---


def test_a_tensorboard_only_run_is_read_beside_a_folder_with_json_lines(tmp_path, capsys):
  # Before: any .jsonl under the parent made inspect ignore every event file, so this run vanished.
  _log(tmp_path / "healthy", _simulate(300, growth_interval=10).rows)
  stuck = _simulate(400, init=2.0**12, ceiling=2.0**20, nonfinite_from=100)
  _log(tmp_path / "stuck", stuck.rows, source="tensorboard")
  report = _inspect_json(tmp_path, capsys)
  assert set(report) == {"healthy", "stuck"}
  assert report["healthy"]["diagnosis"] == []
  (found,) = report["stuck"]["diagnosis"]
  assert found["symptom"].startswith("stuck at the minimum")


def test_the_tensorboard_copy_of_a_run_logged_as_json_lines_is_read_once(tmp_path, capsys):
  # The main example's layout: JSON lines of every run in the folder, events under tb/<run>.
  rows = _simulate(200, growth_interval=10).rows
  with (
    writers.MetricsWriter(tmp_path, run_name="a", tensorboard=False) as js,
    writers.MetricsWriter(tmp_path / "tb" / "a", jsonl=False) as tb,
  ):
    for step, row in enumerate(rows):
      js.log(step, row, wall_s=step + 0.25)  # a wall time, read again for each writer
      if step < 150:  # the TensorBoard copy lags behind (it is flushed every two minutes)
        tb.log(step, row, wall_s=step + 0.5)
  with writers.MetricsWriter(tmp_path / "tb" / "other", jsonl=False) as tb:
    for step, row in enumerate(rows[:50]):
      tb.log(step, {**row, "loss": 5.0})  # another run: not a copy
  assert set(_inspect_json(tmp_path, capsys)) == {"a", "tb/other"}


def test_the_tensorboard_copy_of_a_run_with_named_non_finite_leaves_is_read_once(tmp_path, capsys):
  # Both copies hold the leaf record (a dict): it is compared as such, not as a number.
  _, rows = _localised(120, SPIKES, ceiling=2.0**30, init=2.0**10, growth_interval=10**6)
  with (
    writers.MetricsWriter(tmp_path, run_name="a", tensorboard=False, params=NAMES) as js,
    writers.MetricsWriter(tmp_path / "tb" / "a", jsonl=False, params=NAMES) as tb,
  ):
    for step, row in enumerate(rows):
      js.log(step, row)
      tb.log(step, row)
  report = _inspect_json(tmp_path, capsys)
  assert set(report) == {"a"}
  assert report["a"]["summary"]["nonfinite"]["steps_with_leaves"] == 7


def test_a_rise_of_the_zero_share_from_30_to_45_percent_is_lost_gradients(tmp_path, capsys):
  # A rise of 15 points; before, the late share also had to be twice the early one.
  rows = [_healthy(i) | {"underflow/zero_frac": 0.30 if i < 100 else 0.45} for i in range(200)]
  _write(tmp_path, rows)
  (found,) = _inspect_json(tmp_path, capsys)[tmp_path.name]["diagnosis"]
  assert found["symptom"].startswith(
    "gradients lost to underflow: the share of exactly-zero gradient entries rose from 30.0%"
  )
  assert "45.0%" in found["symptom"]


def test_the_summary_counts_applied_updates_apart_from_skipped_ones(tmp_path, capsys):
  stream = _simulate(300, ceiling=2.0**30, init=2.0**10, spikes=set(range(5, 300, 20)))
  _log(tmp_path, stream.rows)
  skipped = int(stream.skipped.sum())
  assert skipped == 15
  assert cli.main(["inspect", str(tmp_path)]) == 0
  assert "(300 logged steps, 300 updates: 285 applied, 15 skipped)" in capsys.readouterr().out
  summary = _inspect_json(tmp_path, capsys)[tmp_path.name]["summary"]
  assert (summary["updates"], summary["applied_updates"], summary["skips"]) == (300, 285, 15)


def test_the_median_scale_is_a_logged_value(tmp_path, capsys):
  _write(tmp_path, [_row(i, scale) for i, scale in enumerate([2.0**10, 2.0**10, 2.0**12, 2.0**12])])
  summary = _inspect_json(tmp_path, capsys)[tmp_path.name]["summary"]
  assert summary["scale_median"] == 2.0**10  # the lower median; the mean of the middle two is not
  assert cli.main(["inspect", str(tmp_path)]) == 0
  assert "median 2^10 /" in capsys.readouterr().out


# --- Optional dependencies: one line naming the extra, exit status 2 ---

_INSTALL = 'pip install -e ".[monitoring]"'


def _without(monkeypatch, *modules):
  """Makes ``import`` of each of ``modules`` fail, as when the package is not installed."""
  for name in modules:
    monkeypatch.setitem(sys.modules, name, None)


def _one_line_error(capsys):
  err = capsys.readouterr().err
  assert "Traceback" not in err and err.count("\n") == 1, err
  return err


def test_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
  _write_log(tmp_path / "run", '{"step": 0, "loss_scale": 1}\n')
  _without(monkeypatch, "matplotlib", "matplotlib.backend_bases", "matplotlib.pyplot")
  assert cli.main(["inspect", str(tmp_path / "run"), "--plot", str(tmp_path / "out.png")]) == 2
  err = _one_line_error(capsys)
  assert "--plot" in err and "matplotlib" in err and _INSTALL in err
  with pytest.raises(ImportError, match="monitoring"):
    _inspect(tmp_path / "run", plot_path=tmp_path / "out.png")


def test_event_files_without_tensorboard_are_one_line_naming_the_extra(
  tmp_path, capsys, monkeypatch
):
  _log(tmp_path, _simulate(10).rows, source="tensorboard")
  _without(monkeypatch, "tensorboard", "tensorboard.backend.event_processing.event_file_loader")
  assert cli.main(["inspect", str(tmp_path)]) == 2
  err = _one_line_error(capsys)
  assert "TensorBoard event files" in err and "tensorboard" in err and _INSTALL in err
  assert "unreadable" not in err


def test_without_tensorboard_the_json_lines_runs_are_still_reported(tmp_path, capsys, monkeypatch):
  _log(tmp_path / "js", _simulate(10).rows)
  _log(tmp_path / "tb", _simulate(10).rows, source="tensorboard")
  _without(monkeypatch, "tensorboard", "tensorboard.backend.event_processing.event_file_loader")
  assert cli.main(["inspect", str(tmp_path)]) == 0
  captured = capsys.readouterr()
  assert "run js" in captured.out and "run tb" not in captured.out
  assert captured.err.count("\n") == 1 and "folder(s) are not read (tb)" in captured.err
  assert _INSTALL in captured.err


# --- Where the non-finite steps came from ---

NAMES = ["decoder/layers_3/attn/query/kernel", "decoder/layers_3/mlp/kernel", "embed/embedding"]


def _localised(n, spikes, **simulate):
  """A stream whose overflow at update ``t`` (for ``t`` in ``spikes``) came from the leaves
  ``spikes[t] = ({leaf index: "inf" | "nan"}, loss not finite)``, with the metrics the loss
  scaler gives for it: the packed record of the last non-finite step and per-group counts."""
  stream = _simulate(n, spikes=set(spikes), **simulate)
  rows, last, groups = [], None, {"decoder": 0, "embed": 0}
  for t, row in enumerate(stream.rows):
    if t in spikes:
      last = (t + 1, *spikes[t])
      for label in groups:
        groups[label] += any(NAMES[k].startswith(label) for k in spikes[t][0])
    leaves, kinds, loss = (0, {}, False) if last is None else last
    bad = np.zeros(1, np.uint32)
    nan = np.zeros(1, np.uint32)
    for k, kind in kinds.items():
      bad[0] |= np.uint32(1 << k)
      nan[0] |= np.uint32((kind == "nan") << k)
    rows.append(
      row
      | {
        "nonfinite_step": np.int32(leaves),
        "nonfinite_loss": np.bool_(loss),
        "nonfinite_leaves": bad,
        "nonfinite_nan": nan,
      }
      | {f"overflows/{label}": np.int32(c) for label, c in groups.items()}
    )
  return stream, rows


def _log_named(path, rows, every=1, source="jsonl"):
  with writers.MetricsWriter(
    path, every=every, params=NAMES, tensorboard=source == "tensorboard", jsonl=source == "jsonl"
  ) as w:
    for step, row in enumerate(rows):
      w.log(step, row)


QUERY, MLP, EMBED = 0, 1, 2
SPIKES = {t: ({QUERY: "inf"}, False) for t in range(20, 260, 20)} | {
  t: ({EMBED: "nan", MLP: "inf"}, False) for t in (30, 90, 150)
}  # 15 overflows: the query kernel in 12, the embedding (NaN) and the MLP (inf) in 3


def test_the_report_names_the_parameters_behind_the_skips(tmp_path, capsys):
  stream, rows = _localised(300, SPIKES, ceiling=2.0**30, init=2.0**10, growth_interval=10**6)
  assert stream.skipped.sum() == 15
  _log_named(tmp_path, rows)
  assert cli.main(["inspect", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  assert "  non-finite steps by parameter (the 15 the logs record):" in text
  assert "    decoder/layers_3/attn/query/kernel  12 of 15 (inf)" in text
  assert "    decoder/layers_3/mlp/kernel  3 of 15 (inf)" in text
  assert "    embed/embedding  3 of 15 (nan)" in text
  assert "  overflows    by parameter group: decoder 15, embed 3" in text
  assert (
    "  last non-finite step 240 (nonfinite_step 241 in metrics): "
    "decoder/layers_3/attn/query/kernel (inf)" in text
  )
  summary = _inspect_json(tmp_path, capsys)[tmp_path.name]["summary"]
  where = summary["nonfinite"]
  assert (where["steps_seen"], where["steps_with_leaves"], where["numbering"]) == (15, 15, "step")
  assert where["by_parameter"][0] == {"name": NAMES[QUERY], "steps": 12, "inf": 12, "nan": 0}
  assert where["last"] == {
    "step": 240,
    "update": 241,
    "leaves": {NAMES[QUERY]: "inf"},
    "loss": False,
  }
  assert summary["overflows_by_group"] == {"decoder": 15, "embed": 3}


def test_logs_every_k_steps_say_how_many_non_finite_steps_they_record(tmp_path, capsys):
  _, rows = _localised(300, SPIKES, ceiling=2.0**30, init=2.0**10, growth_interval=10**6)
  _log_named(tmp_path, rows, every=50)
  assert cli.main(["inspect", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  # Logged at steps 0, 50, ..., 250: each row names the last non-finite step before it, the
  # overflows at updates 40, 100, 150 (the embedding's), 200 and 240.
  assert "non-finite steps by parameter (the 5 the logs record, of 15 skipped" in text
  assert "    decoder/layers_3/attn/query/kernel  4 of 5 (inf)" in text
  assert "    embed/embedding  1 of 5 (nan)" in text


def test_a_non_finite_loss_is_reported_with_its_steps(tmp_path, capsys):
  spikes = {120: ({QUERY: "nan"}, True), 200: ({QUERY: "inf"}, False), 340: ({EMBED: "nan"}, True)}
  _, rows = _localised(400, spikes, ceiling=2.0**30, init=2.0**10, growth_interval=10**6)
  _log_named(tmp_path, rows)
  (found,) = _inspect_json(tmp_path, capsys)[tmp_path.name]["diagnosis"]
  assert found["symptom"] == (
    "non-finite loss: the loss itself was not finite on steps 120, 340: loss scaling cannot fix "
    "this, look at the data or the model"
  )
  assert "all_finite(batch)" in found["advice"]


def test_a_non_finite_loss_is_found_in_tensorboard_logs_too(tmp_path, capsys):
  spikes = {50: ({QUERY: "nan"}, True)}
  _, rows = _localised(100, spikes, ceiling=2.0**30, init=2.0**10, growth_interval=10**6)
  _log_named(tmp_path, rows, source="tensorboard")
  report = _inspect_json(tmp_path, capsys)[tmp_path.name]
  assert [d["symptom"][:40] for d in report["diagnosis"]] == [
    "non-finite loss: the loss itself was not"
  ]
  where = report["summary"]["nonfinite"]
  assert where["steps_with_leaves"] == 1
  assert where["last"] == {"step": 50, "update": 51, "leaves": {NAMES[QUERY]: "nan"}, "loss": True}


def test_the_advice_tells_nan_from_inf_and_names_the_parameters(tmp_path, capsys):
  often = range(25, 900, 50)  # overflow spikes that no growth undoes: frequent overflow
  for kind, leaf in (("inf", QUERY), ("nan", EMBED)):
    _, rows = _localised(
      900,
      {t: ({leaf: kind}, False) for t in often},
      growth_interval=10**6,
      init=2.0**24,
      ceiling=2.0**30,
    )
    _log_named(tmp_path / kind, rows)
  report = _inspect_json(tmp_path, capsys)
  ((inf_symptom, inf_advice),) = [(d["symptom"], d["advice"]) for d in report["inf"]["diagnosis"]]
  ((nan_symptom, nan_advice),) = [(d["symptom"], d["advice"]) for d in report["nan"]["diagnosis"]]
  assert inf_symptom.startswith("frequent overflow")
  assert f"held infinities in {NAMES[QUERY]}" in inf_advice and "backs off by itself" in inf_advice
  assert "NaN" not in inf_advice
  # NaN skips are no overflow, however frequent: a bug that no loss scale cures.
  assert nan_symptom.startswith("NaN, not overflow: every one of the 18 non-finite steps")
  assert NAMES[EMBED] in nan_symptom and "no loss scale cures" in nan_symptom
  assert "0/0" in nan_advice and "infinities" not in nan_advice


def test_a_run_whose_few_skips_all_held_nan_is_not_called_problem_free(tmp_path, capsys):
  _, rows = _localised(
    300, {t: ({EMBED: "nan"}, False) for t in (50, 180)}, ceiling=2.0**30, init=2.0**10
  )
  _log_named(tmp_path, rows)
  assert cli.main(["inspect", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  assert "no loss-scaling problems found" not in text
  assert "! NaN, not overflow: every one of the 2 non-finite steps" in text


def test_keys_of_features_not_in_use_are_unknown_not_zero(tmp_path, capsys):
  # fp32_fallback and the recompute counters appear in the metrics only with those features.
  _log(tmp_path, _simulate(50).rows)
  (report,) = _inspect_json(tmp_path, capsys).values()
  assert report["summary"]["fp32_fallback_steps"] is None and "nonfinite" not in report["summary"]
  _log(tmp_path / "fb", [r | {"fp32_fallback": i >= 45} for i, r in enumerate(_simulate(50).rows)])
  assert _inspect_json(tmp_path / "fb", capsys)["fb"]["summary"]["fp32_fallback_steps"] == 5


def test_the_plot_draws_the_scale_as_steps_not_ramps(tmp_path, monkeypatch):
  """The scale holds from one logged step to the next: a ramp between two logged scales
  would show scales the run never used."""
  import matplotlib.pyplot as plt

  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  _log(tmp_path / "run", _simulate(60, spikes={20, 40}).rows)
  _inspect(tmp_path, plot_path=tmp_path / "p.png")
  (fig,) = figures
  scale_line = fig.axes[0].lines[0]
  assert scale_line.get_drawstyle() == "steps-post" and scale_line.get_label() == "run"


def test_every_optax_dls_name_the_messages_and_docstrings_give_exists():
  """Advice that names a function the package does not have (optax_dls.locate) sends the
  user nowhere: every dotted optax_dls name in the package's source resolves."""
  import importlib
  import pathlib

  missing = []
  for path in sorted(pathlib.Path(optax_dls.__file__).parent.rglob("*.py")):
    for name in sorted(set(re.findall(r"\boptax_dls(?:\.[A-Za-z_]\w*)+", path.read_text()))):
      obj, parts = optax_dls, name.split(".")
      for i, part in enumerate(parts[1:], start=2):
        try:
          obj = (
            getattr(obj, part)
            if hasattr(obj, part)
            else importlib.import_module(".".join(parts[:i]))
          )
        except ImportError:
          missing.append(f"{path.name}: {name}")
          break
  assert not missing


def test_a_skip_between_two_logged_rows_is_a_streak_of_at_least_one(tmp_path, capsys):
  rows = [
    {"num_steps": 1, "skip_count": 0, "consecutive_skips": 0, "loss_scale": 32768.0},
    {"num_steps": 11, "skip_count": 1, "consecutive_skips": 0, "loss_scale": 16384.0},
  ]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(
      json.dumps({"step": step, **row}) + "\n" for step, row in zip((0, 10), rows, strict=True)
    )
  cli.main(["inspect", str(tmp_path)])
  assert "longest streak at least 1" in capsys.readouterr().out


# --- How inspect shows scales, a saved locate report and the plot ---


def _saved_locate(path, scale, scopes):
  """A ``locate.json`` as ``MetricsWriter.write_locate`` saves it, with a row per scope."""
  rows = [
    {
      "scope": scope,
      "forward_fraction": fraction,
      "backward_fraction": 0.5,
      "forward_overflow": False,
      "backward_overflow": False,
      "underflow_share": 0.0,
      "first_overflow": -1,
    }
    for scope, fraction in scopes
  ]
  first = {
    "phase": "backward",
    "primitive": "dot_general",
    "source": "model.py:3",
    "scope": scopes[0][0],
    "kind": "inf",
    "dtype": "float16",
    "input_max": 1.0,
    "note": "",
  }
  data = {"step": 3, "scale": scale, "first": first, "headroom": rows}
  (path / writers.LOCATE_NAME).write_text(json.dumps(data))


def test_the_saved_locate_table_shows_whole_scope_names_and_no_top_level_row(tmp_path, capsys):
  long = "Transformer/decoder/layers_11/self_attention/query_key_value/Dense_0"
  _write(tmp_path, [_row(i) for i in range(3)])
  _saved_locate(tmp_path, 2.0**26, [(long, 0.9), ("(top level)", 1.0), ("embed", 0.1)])
  assert cli.main(["inspect", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  table = text[text.index("locate at loss scale") :].splitlines()
  assert table[0] == "locate at loss scale 2^26:" and "6.71089e+07" not in text
  assert any(line.strip().startswith(long + " ") for line in table), table
  assert any(line.strip().startswith("embed ") for line in table), table
  assert not any(line.strip().startswith("(top level)") for line in table), table


def test_a_scale_that_is_not_a_power_of_two_is_shown_as_a_fractional_power(tmp_path, capsys):
  _write(tmp_path, [_row(i, scale) for i, scale in enumerate([1500.0, 2.0**26, 2.0**26])])
  assert cli.main(["inspect", str(tmp_path)]) == 0
  text = capsys.readouterr().out
  assert "lowest 2^10.55 / median 2^26 / highest 2^26 (logged)" in text, text
  assert "1500" not in text and "e+07" not in text


def test_the_plot_has_a_panel_per_quantity_and_marks_skipped_and_recomputed_steps(
  tmp_path, monkeypatch
):
  import matplotlib.pyplot as plt

  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  rows = _simulate(60, ceiling=2.0**30, init=2.0**10, spikes={20, 40}).rows
  for i, row in enumerate(rows):  # steps 10 and 30 recomputed after an overflow
    row["recomputed_steps"] = (i >= 10) + (i >= 30)
    row["recompute_tries"] = row["recomputed_steps"]
  _log(tmp_path / "run", rows)
  _inspect(tmp_path, plot_path=tmp_path / "p.png")
  (fig,) = figures
  axes = fig.axes
  labels = [ax.get_ylabel() for ax in axes]
  assert labels[0].startswith("loss scale") and axes[0].get_yscale() == "log"
  assert axes[0].yaxis.get_transform().base == 2
  for quantity in ("loss", "grad norm", "skipped", "recomputed"):
    assert any(label.startswith(quantity) for label in labels), labels
  assert all(ax.get_shared_x_axes().joined(axes[0], ax) for ax in axes)
  marks = {line.get_label(): line for line in axes[0].lines}
  assert list(marks["run: skipped"].get_xdata()) == [20, 40]
  assert list(marks["run: recomputed"].get_xdata()) == [10, 30]
  assert marks["run: skipped"].get_marker() != marks["run: recomputed"].get_marker()


@pytest.mark.parametrize("fallback", [False, True])
def test_stuck_at_the_minimum_advises_the_fallback_only_where_it_is_off(fallback):
  from optax_dls._logs import diagnosis

  extra = lambda i: {"fp32_fallback": i > 110} if fallback else {}
  rows = [SYMPTOMS["stuck at the minimum"](i) | extra(i) | {"step": i} for i in range(300)]
  found = dict(diagnosis.diagnose(rows, diagnosis.summarize(rows)))
  advice = next(a for s, a in found.items() if s.startswith("stuck at the minimum"))
  assert ("turn on optax_dls.fp32_fallback" in advice) is not fallback
  assert ("the float32 fallback did not end the skips" in advice) is fallback
