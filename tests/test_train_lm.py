"""End to end: examples/train_lm.py at a tiny size, its outputs, and its --text errors."""

import json
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import train_lm  # noqa: E402

RUNS = ("fp32", "fp16", "fp16-dls")
STEPS = 10
TINY = ["--steps", str(STEPS), "--batch-size", "4", "--seq-len", "16", "--d-model", "16",
        "--layers", "1", "--heads", "2", "--eval-every", "5", "--eval-batches", "2", "--lr", "1e-2"]
TRAIN_KEYS = {"run", "kind", "step", "loss", "loss_scale", "skipped", "skip_count", "update_ratio",
              "grad_norm", "wall_s"}
EVAL_KEYS = {"run", "kind", "step", "val_loss", "wall_s"}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
  out = tmp_path_factory.mktemp("train_lm")
  assert train_lm.main(TINY + ["--out", str(out)]) == 0
  return out


def records(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_metrics_jsonl_has_every_step_of_every_run(out):
  recs = records(out)
  for run in RUNS:
    train = [r for r in recs if r["run"] == run and r["kind"] == "train"]
    evals = [r for r in recs if r["run"] == run and r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [0, 5, 10]
    assert all(set(r) == TRAIN_KEYS for r in train)
    assert all(set(r) == EVAL_KEYS for r in evals)
    assert all(isinstance(r["skipped"], bool) for r in train)
  scales = {r["loss_scale"] for r in recs if r["run"] == "fp16-dls" and r["kind"] == "train"}
  assert all(s > 1 for s in scales)
  assert {r["loss_scale"] for r in recs if r["run"] == "fp32" and r["kind"] == "train"} == {1.0}


def test_plot_and_tensorboard_files(out):
  assert (out / "train_lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for run in RUNS:
    events = list((out / "tb" / run).glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_summary_and_diagnostic(out):
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["runs"]) == set(RUNS)
  for row in summary["runs"].values():
    assert set(row) == {"train_loss", "val_loss", "skipped", "update_ratio", "loss_scale", "wall_s"}
    assert 0 <= row["update_ratio"] <= 1 and row["wall_s"] > 0
  diag = json.loads((out / "diagnostic.json").read_text())
  assert diag["points"] == summary["diagnostic"]
  assert [p["step"] for p in diag["points"]] == [0, STEPS // 2, STEPS]
  for p in diag["points"]:
    for run in ("fp16", "fp16-dls"):
      assert 0 <= p[run]["zeroed_fraction"] <= 1
      assert p[run]["finite"] and 0 < p[run]["rel_error"] < 1  # fp16 differs from fp32, but not wildly


def test_loss_scaled_run_learns(out):
  val = [r["val_loss"] for r in records(out) if r["run"] == "fp16-dls" and r["kind"] == "eval"]
  assert val[-1] < val[0]


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
