"""optax-dls inspect: summary, diagnosis and plot from JSONL / TensorBoard logs."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls import cli, writers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_lm.py")


def _inspect_json(path, capsys, *extra):
  assert cli.main(["inspect", str(path), "--json", *extra]) == 0
  return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A real tiny fp16 training loop with overflowing batches at known steps, logged by MetricsWriter."""
  out = tmp_path_factory.mktemp("run")
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**8, growth_interval=4, alerts=False)
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
  with writers.MetricsWriter(out, every=1, run_name="tiny") as w:
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
  assert (s["scale_min"], s["scale_median"], s["scale_max"]) == (scales.min(), np.median(scales), scales.max())
  assert s["steps_at_min_scale"] == int((scales == scales.min()).sum())
  assert s["steps_at_max_scale"] == int((scales == scales.max()).sum())
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_output_and_tensorboard_only_folder(trained, capsys, tmp_path):
  out, _, _ = trained
  assert cli.main(["inspect", str(out)]) == 0
  text = capsys.readouterr().out
  assert "run tiny" in text and "longest streak 3" in text
  # The same run read back from its TensorBoard events only.
  tb_dir = tmp_path / "tb"
  tb_dir.mkdir()
  for name in os.listdir(out):
    if name.startswith("events.out.tfevents"):
      os.link(out / name, tb_dir / name)
  from_tb = _inspect_json(tb_dir, capsys)["tb"]["summary"]
  from_jsonl = _inspect_json(out, capsys)["tiny"]["summary"]
  assert from_tb == from_jsonl


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
  return {"loss_scale": scale, "skipped": skipped, "skip_count": skips, "num_steps": i + 1,
          "consecutive_skips": int(skipped), "loss": loss, **extra}


def _healthy(i):
  return _row(i, scale=2.0 ** (10 + i // 50), loss=2.0 - i / 400)


SYMPTOMS = {
    "frequent overflow": lambda i: _row(i, 2.0**10, i % 5 == 0, i // 5 + 1, 2 - i / 400),
    "scale never grows": lambda i: _row(i, 2.0**12, loss=2 - i / 2000),
    "gradients too small": lambda i: _healthy(i) | {"underflow/subnormal_frac": 0.2, "underflow/zero_frac": 0.1},
    "stuck at the minimum": lambda i: _row(i, 1.0 if i > 100 else 2.0**12, i > 100, max(i - 100, 0),
                                           2 - i / 400),
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
  _write(tmp_path, [_row(i, 2.0 ** (10 + (i % 10 == 9)), i % 10 == 0, i // 10 + 1, 2 - i / 400)
                    for i in range(200)])
  assert _inspect_json(tmp_path, capsys)[tmp_path.name]["diagnosis"] == []


def test_healthy_run_has_no_diagnosis(tmp_path, capsys):
  _write(tmp_path, [_healthy(i) for i in range(200)])
  report = _inspect_json(tmp_path, capsys)[tmp_path.name]
  assert report["diagnosis"] == [] and report["summary"]["scale_increases"] == 3


@pytest.mark.skipif(not os.path.exists(EXAMPLE), reason="examples/train_lm.py not present")
def test_inspect_logs_of_the_main_example(tmp_path, capsys):
  sys.path.insert(0, os.path.dirname(EXAMPLE))
  import train_lm  # noqa: E402

  out = tmp_path / "example"
  flags = ["--runs", "fp16-dls", "--steps", "4", "--batch-size", "2", "--seq-len", "8", "--d-model", "8",
           "--layers", "1", "--heads", "1", "--eval-every", "4", "--eval-batches", "1", "--out", str(out)]
  assert train_lm.main(flags) == 0
  capsys.readouterr()
  s = _inspect_json(out, capsys)["fp16-dls"]["summary"]
  rows = [r for r in writers.read_jsonl(out / "metrics.jsonl") if "loss_scale" in r]
  assert s["updates"] == 4 == len(rows)
  assert s["skips"] == max(r["skip_count"] for r in rows)
  assert s["scale_max"] == max(r["loss_scale"] for r in rows)


def _write_log(path, text, mode="w"):
  path.mkdir(parents=True, exist_ok=True)
  with open(path / "metrics.jsonl", mode) as f:
    f.write(text)


@pytest.mark.parametrize("bad", ['"abc"', "null", "NaN", "1.5", "1e400", "Infinity", "true", str(10**30)])
def test_rows_with_a_malformed_step_are_skipped_with_a_warning(bad, tmp_path, capsys):
  _write_log(tmp_path, '{"step": 0, "loss_scale": 1024}\n{"step": %s, "loss_scale": 2}\n'
             '{"step": 1, "loss_scale": 512, "num_steps": Infinity, "skip_count": %s}\n' % (bad, 10**400))
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  captured = capsys.readouterr()
  (summary,) = [r["summary"] for r in json.loads(captured.out).values()]
  assert (summary["logged_steps"], summary["scale_min"], summary["scale_max"]) == (2, 512, 1024)
  assert "skipped 1 row(s)" in captured.err


@pytest.mark.parametrize("content", [b'{"step": "a"}\n{"step": null}\n', bytes(range(256)) * 2,
                                     b'{"step": 0, "loss_scale": 1024\n{garbage\n'])
def test_all_corrupt_logs_exit_2_saying_they_are_unreadable(content, tmp_path, capsys):
  tmp_path.joinpath("metrics.jsonl").write_bytes(content)
  assert cli.main(["inspect", str(tmp_path)]) == 2
  assert "exist but are unreadable" in capsys.readouterr().err


def test_corrupt_event_file_exits_2(tmp_path, capsys):
  tmp_path.joinpath("events.out.tfevents.1").write_bytes(b"\x05" + bytes(range(256)) * 2)
  assert cli.main(["inspect", str(tmp_path)]) == 2
  assert "exist but are unreadable" in capsys.readouterr().err


@pytest.mark.parametrize("plot, message", [("missing/out.png", "does not exist"), ("out.xyz", "extension")])
def test_bad_plot_path_is_an_argument_error(plot, message, tmp_path, capsys):
  _write_log(tmp_path / "run", '{"step": 0, "loss_scale": 1}\n')
  with pytest.raises(SystemExit) as e:
    cli.main(["inspect", str(tmp_path / "run"), "--plot", str(tmp_path / plot)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "--plot" in err and message in err
