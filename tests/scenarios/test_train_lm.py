"""End to end: examples/train_lm.py at a tiny size, its outputs, inspect on them, and its flag errors."""

import contextlib
import io
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_dls import cli

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import train_lm  # noqa: E402

RUNS = ("fp32", "fp16", "fp16-dls")
STEPS = 10
TINY = ["--steps", str(STEPS), "--batch-size", "4", "--seq-len", "16", "--d-model", "16",
        "--layers", "1", "--heads", "2", "--eval-every", "5", "--eval-batches", "2", "--lr", "1e-2"]
# The loss of each step averaged over 4096 replicas x 2 micro-batches x 4 x 16 tokens: per-token
# gradients of p / 524,288, which float16 cannot hold without loss scaling.
REGIME = ["--replicas", "4096", "--micro-batches", "2"]
TRAIN_KEYS = {"run", "step", "loss", "loss_scale", "skipped", "skip_count", "consecutive_skips", "num_steps",
              "update_ratio", "grad_norm", "fp32_fallback", "underflow/zero_frac", "underflow/subnormal_frac",
              "wall_s"}
EVAL_KEYS = {"run", "step", "val_loss", "wall_s"}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
  out = tmp_path_factory.mktemp("train_lm")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert train_lm.main(TINY + REGIME + ["--out", str(out)]) == 0
  (out / "stdout.txt").write_text(printed.getvalue())
  return out


def records(out, run):
  with open(out / "metrics.jsonl") as f:
    return [r for r in map(json.loads, f) if r["run"] == run]


def train_rows(out, run):
  return [r for r in records(out, run) if "loss" in r]


def test_metrics_jsonl_has_every_step_of_every_run(out):
  for run in RUNS:
    recs = records(out, run)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "val_loss" in r]
    assert len(train) + len(evals) == len(recs)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [0, 5, 10]
    assert all(set(r) == TRAIN_KEYS and r["run"] == run for r in train)
    assert all(set(r) == EVAL_KEYS for r in evals)
    assert all(isinstance(r["skipped"], bool) for r in train)
  assert all(r["loss_scale"] > 1 for r in train_rows(out, "fp16-dls"))
  assert {r["loss_scale"] for r in train_rows(out, "fp32")} == {1.0}


def test_fp16_loses_gradient_entries_that_loss_scaling_keeps(out):
  zeros = {run: [r["underflow/zero_frac"] for r in train_rows(out, run)] for run in RUNS}
  for fp32, fp16, dls in zip(zeros["fp32"], zeros["fp16"], zeros["fp16-dls"]):
    assert fp16 > fp32 + 0.1  # entries that float16 flushed to zero
    assert abs(dls - fp32) < 0.01  # the fp32 floor: embedding rows of bytes absent from the batch


def test_plot_and_tensorboard_files(out):
  assert (out / "train_lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for run in RUNS:
    events = list((out / "tb" / run).glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_summary(out):
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["runs"]) == set(RUNS)
  assert summary["tokens_per_step"] == 4096 * 2 * 4 * 16
  for row in summary["runs"].values():
    assert set(row) == {"train_loss", "val_loss", "zero_frac", "skipped", "loss_scale", "wall_s"}
    assert 0 <= row["zero_frac"] <= 1 and row["wall_s"] > 0


def test_loss_scaled_run_learns(out):
  val = [r["val_loss"] for r in records(out, "fp16-dls") if "val_loss" in r]
  assert val[-1] < val[0]


def test_redirected_output_is_plain_lines(out):
  printed = (out / "stdout.txt").read_text()
  assert "\r" not in printed and "fp16-dls: step 10/10" in printed
  assert "vs fp32" in printed and f"optax-dls inspect {out}" in printed


def test_inspect_reads_every_run_and_flags_the_unscaled_fp16_run(out):
  report = json.loads(cli.inspect(str(out), as_json=True))
  assert set(report) == set(RUNS)
  assert all(r["summary"]["updates"] == STEPS for r in report.values())
  assert any("zero" in d["symptom"] for d in report["fp16"]["diagnosis"])


def test_replicas_change_only_the_backward_pass_normalisation():
  """In float32 the stand-in for the sum over replicas gives the mean-loss gradient back."""
  steps = {}
  for replicas in (1, 4096):
    args = train_lm.parse_args(TINY + ["--replicas", str(replicas), "--micro-batches", "2"])
    model = train_lm.Transformer(args.d_model, args.layers, args.heads, args.seq_len, train_lm.FP32)
    params = model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    tx = train_lm.make_optimizer("fp32", args)
    batches = train_lm.data.gather(args.train, np.arange(8).reshape(2, 4) * 1000, args.seq_len + 1)
    steps[replicas] = train_lm.make_train_step(model, tx, args)(params, tx.init(params), batches)[2]
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(steps[4096][key], steps[1][key], rtol=1e-5)


def test_runs_subset_is_parsed_in_order():
  assert train_lm.parse_args(["--runs", "fp16-dls, fp32"]).runs == ["fp16-dls", "fp32"]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"", "file is empty"),
    (b"too short", "needs at least"),
    (b"\xff\xfe not utf-8 " * 50, "is not UTF-8"),
])
def test_text_errors_exit_2_with_a_message(tmp_path, capsys, content, message):
  path = tmp_path / "corpus.txt"
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(SystemExit) as e:
    train_lm.main(["--text", str(path), "--out", str(tmp_path / "out")])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage:" in err and message in err and "Traceback" not in err
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--runs", "fp32,bf16"], "--runs"),
    (["--heads", "3"], "--heads"),
    (["--steps", "0"], "--steps"),
    (["--replicas", "0"], "--replicas"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
])
def test_bad_flags_exit_2(tmp_path, capsys, flags, message):
  with pytest.raises(SystemExit) as e:
    train_lm.main(flags + ["--out", str(tmp_path / "out")])
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_out_an_existing_file_exits_2(tmp_path, capsys):
  path = tmp_path / "afile"
  path.write_text("keep me")
  with pytest.raises(SystemExit) as e:
    train_lm.parse_args(["--out", str(path)])
  assert e.value.code == 2 and "--out" in capsys.readouterr().err and path.read_text() == "keep me"


def test_text_file_is_split_90_10(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("é" * 1000, encoding="utf-8")  # 2000 bytes
  args = train_lm.parse_args(["--text", str(path), "--seq-len", "8"])
  assert (args.train.size, args.val.size) == (1800, 200)
  assert bytes(args.train[:2]) == "é".encode("utf-8")
