"""End to end: examples/train_lm.py at a tiny size, its outputs, inspect on them, and its flag
errors."""

import contextlib
import io
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_dls
from optax_dls._access.names import leaf_names
from optax_dls._logs.report import inspect

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import train_lm

RUNS = ("fp32", "fp16", "fp16-dls", "fp16-dls-recompute")
STEPS = 10
TINY = [
  "--steps",
  str(STEPS),
  "--batch-size",
  "4",
  "--seq-len",
  "16",
  "--d-model",
  "16",
  "--layers",
  "1",
  "--heads",
  "2",
  "--eval-every",
  "5",
  "--eval-batches",
  "2",
  "--lr",
  "1e-2",
]
# The loss of each step averaged over 4096 replicas x 2 micro-batches x 4 x 16 tokens: per-token
# gradients of p / 524,288, which float16 cannot hold without loss scaling. The loss-scaled runs
# start at 2**31, where some micro-batches overflow: fp16-dls skips those steps, fp16-dls-recompute
# recomputes them.
REGIME = [
  "--replicas",
  "4096",
  "--micro-batches",
  "2",
  "--init-scale",
  str(2.0**31),
  "--max-scale",
  str(2.0**40),
]
TRAIN_KEYS = {
  "run",
  "step",
  "loss",
  "loss_scale",
  "skipped",
  "skip_count",
  "consecutive_skips",
  "num_steps",
  "update_ratio",
  "grad_norm",
  "nonfinite_step",
  "nonfinite_loss",
  "recomputed_steps",
  "recompute_tries",
  "underflow/zero_frac",
  "underflow/subnormal_frac",
  "wall_s",
}
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
    # A row of a new non-finite step also names its leaves (nonfinite_leaves).
    assert all(set(r) - {"nonfinite_leaves"} == TRAIN_KEYS and r["run"] == run for r in train)
    assert all(set(r) == EVAL_KEYS for r in evals)
    assert all(isinstance(r["skipped"], bool) for r in train)
  assert all(
    r["loss_scale"] > 1 for r in train_rows(out, "fp16-dls") + train_rows(out, "fp16-dls-recompute")
  )
  assert {r["loss_scale"] for r in train_rows(out, "fp32")} == {1.0}


def test_fp16_loses_gradient_entries_that_loss_scaling_keeps(out):
  rows = {run: train_rows(out, run) for run in RUNS}
  for fp32, fp16, dls, recompute in zip(*rows.values()):
    assert (
      fp16["underflow/zero_frac"] > fp32["underflow/zero_frac"] + 0.1
    )  # flushed to zero by float16
    # The fp32 floor (embedding rows of bytes absent from the batch), on every applied step.
    for scaled in (dls, recompute) if not dls["skipped"] else (recompute,):
      assert abs(scaled["underflow/zero_frac"] - fp32["underflow/zero_frac"]) < 0.01


def test_recompute_run_applies_every_step_that_fp16_dls_skips(out):
  dls, recompute = train_rows(out, "fp16-dls"), train_rows(out, "fp16-dls-recompute")
  assert dls[-1]["skip_count"] >= 1 and not any(r["skipped"] for r in recompute)
  assert (
    recompute[-1]["recomputed_steps"] >= 1
    and recompute[-1]["recompute_tries"] >= recompute[-1]["recomputed_steps"]
  )
  assert dls[-1]["recompute_tries"] == 0
  # The same batches, and no step lost: its training loss is fp32's to float16 rounding.
  np.testing.assert_allclose(
    [r["loss"] for r in recompute], [r["loss"] for r in train_rows(out, "fp32")], rtol=1e-2
  )
  row = json.loads((out / "summary.json").read_text())["runs"]["fp16-dls-recompute"]
  assert row["skipped"] == 0 and row["recomputed"] == recompute[-1]["recomputed_steps"]
  assert row["extra_passes"] == recompute[-1]["recompute_tries"] / (
    STEPS * 2
  )  # 2 micro-batches a step


def test_plot_and_tensorboard_files(out):
  assert (out / "train_lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for run in RUNS:
    events = list((out / "tb" / run).glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_summary(out):
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["runs"]) == set(RUNS)
  assert summary["tokens_per_step"] == 4096 * 2 * 4 * 16
  for name, row in summary["runs"].items():
    assert set(row) == {
      "train_loss",
      "val_loss",
      "zero_frac",
      "skipped",
      "recomputed",
      "extra_passes",
      "loss_scale",
      "skips_by_parameter",
      "located",
      "wall_s",
    }
    assert 0 <= row["zero_frac"] <= 1 and row["wall_s"] > 0
    assert bool(row["skips_by_parameter"]) == (row["skipped"] > 0)
    assert (
      (row["recomputed"] is None) == (row["extra_passes"] is None) == (name != "fp16-dls-recompute")
    )


def _leaf_names():
  args = train_lm.parse_args(TINY)
  model = train_lm.Transformer(args.d_model, args.layers, args.heads, args.seq_len, train_lm.FP32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))
  return leaf_names(shapes["params"])


def test_skipped_steps_name_the_parameters_that_overflowed(out):
  """fp16-dls at 2**31: each skipped step's row names the leaves that overflowed (inf), and the
  summary counts them per parameter."""
  names = _leaf_names()
  dls = train_rows(out, "fp16-dls")
  skipped = [r for r in dls if r["skipped"]]
  assert skipped and [r["step"] for r in dls if "nonfinite_leaves" in r] == [
    r["step"] for r in skipped
  ]
  for r in skipped:
    assert r["nonfinite_step"] == r["num_steps"] and r["nonfinite_leaves"]
    assert set(r["nonfinite_leaves"]) <= set(names)
    assert set(r["nonfinite_leaves"].values()) == {"inf"}
  counts = json.loads((out / "summary.json").read_text())["runs"]["fp16-dls"]["skips_by_parameter"]
  expected = {}
  for r in skipped:
    for leaf in r["nonfinite_leaves"]:
      expected.setdefault(leaf, {"inf": 0, "nan": 0})["inf"] += 1
  assert counts == expected
  # Most skipped steps first.
  totals = [c["inf"] + c["nan"] for c in counts.values()]
  assert totals == sorted(totals, reverse=True)


def test_first_skipped_step_is_located(out):
  """fp16-dls runs optax_dls.locate once, on the batch of its first skipped step: saved as
  locate.json, in summary.json, and printed with the operation and the three nearest scopes."""
  first_skip = next(r["step"] for r in train_rows(out, "fp16-dls") if r["skipped"])
  saved = json.loads((out / "locate.json").read_text())
  assert saved["step"] == first_skip and saved["scale"] == 2.0**31
  located = json.loads((out / "summary.json").read_text())["runs"]["fp16-dls"]["located"]
  assert located["first"] == saved["first"] and located["first"]["kind"] in ("inf", "nan")
  printed = (out / "stdout.txt").read_text()
  block = printed[printed.index("Located with optax_dls.locate") :].split("\n\n")[0]
  assert located["first"]["primitive"] in block and located["first"]["phase"] in block
  rows = block.splitlines()[2:]
  assert len(rows) == 3
  assert all(r.strip().startswith(h["scope"]) for r, h in zip(rows, located["headroom"]))
  assert f"the batch of step {first_skip}" in inspect(str(out))


def test_loss_scaled_run_learns(out):
  val = [r["val_loss"] for r in records(out, "fp16-dls") if "val_loss" in r]
  assert val[-1] < val[0]


def test_redirected_output_is_plain_lines(out):
  printed = (out / "stdout.txt").read_text()
  assert "\r" not in printed and "fp16-dls: step 10/10" in printed
  assert "fp16-dls-recompute: step 10/10" in printed and "recomputed" in printed
  assert (
    "vs fp32" in printed and "extra passes" in printed and f"optax-dls inspect {out}" in printed
  )
  counts = json.loads((out / "summary.json").read_text())["runs"]["fp16-dls"]["skips_by_parameter"]
  skips = printed[printed.index("Skips by parameter") :]
  assert "fp16-dls, " in skips and all(f"{leaf}  " in skips for leaf in list(counts)[:5])
  assert "(inf)" in skips


def test_inspect_reads_every_run_and_flags_the_unscaled_fp16_run(out):
  report = json.loads(inspect(str(out), as_json=True))
  assert set(report) == set(RUNS)
  assert all(r["summary"]["updates"] == STEPS for r in report.values())
  assert any("zero" in d["symptom"] for d in report["fp16"]["diagnosis"])
  # The parameters behind fp16-dls's overflows, as the example's summary counts them.
  counts = json.loads((out / "summary.json").read_text())["runs"]["fp16-dls"]["skips_by_parameter"]
  where = report["fp16-dls"]["summary"]["nonfinite"]
  assert where["steps_with_leaves"] == report["fp16-dls"]["summary"]["skips"]
  assert {e["name"]: {"inf": e["inf"], "nan": e["nan"]} for e in where["by_parameter"]} == counts
  text = inspect(str(out))
  dls = text.split("run fp16-dls\n")[1].split("\nrun ")[0]
  assert "non-finite steps by parameter" in dls
  assert f"{next(iter(counts))}  " in dls and "(inf)" in dls


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


def test_a_recomputed_micro_batch_brings_the_earlier_ones_to_its_scale():
  """The step equals one run directly at the final scale: the sum so far follows the backoff."""
  args = train_lm.parse_args(
    TINY + ["--replicas", "4096", "--micro-batches", "2", "--init-scale", str(2.0**31)]
  )
  model = train_lm.Transformer(args.d_model, args.layers, args.heads, args.seq_len, train_lm.FP16)
  params = model.init(jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
  # At 2**31 the first micro-batch's gradients fit float16 and the second's overflow.
  starts = np.stack([np.arange(4) * 1000 + 37, np.arange(4) * 1000])
  batches = train_lm.data.gather(args.train, starts, args.seq_len + 1)
  tx = train_lm.make_optimizer("fp16-dls-recompute", args)
  new, _, m = train_lm.make_train_step(model, tx, args, max_tries=3)(
    params, tx.init(params), batches
  )
  assert (
    int(m["recompute_tries"]) == 1
    and int(m["skip_count"]) == 0
    and float(m["loss_scale"]) == 2.0**30
  )
  plain = train_lm.make_optimizer("fp16-dls", args)
  direct = optax_dls.reset_scale(plain.init(params), 2.0**30)
  new_d, _, m_d = train_lm.make_train_step(model, plain, args)(params, direct, batches)
  assert float(m["loss"]) == float(m_d["loss"]) and int(m_d["skip_count"]) == 0
  # The gradient norm shows the sum (Adam's first update is about lr * sign(g) either way).
  np.testing.assert_allclose(m["grad_norm"], m_d["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_d)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_runs_subset_is_parsed_in_order():
  assert train_lm.parse_args(["--runs", "fp16-dls, fp32"]).runs == ["fp16-dls", "fp32"]


@pytest.mark.parametrize(
  "content, message",
  [
    (None, "no such file"),
    (b"", "file is empty"),
    (b"too short", "needs at least"),
    (b"\xff\xfe not utf-8 " * 50, "is not UTF-8"),
  ],
)
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


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--runs", "fp32,bf16"], "--runs"),
    (["--heads", "3"], "--heads"),
    (["--steps", "0"], "--steps"),
    (["--replicas", "0"], "--replicas"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--max-tries", "-1"], "--max-tries"),
    (["--init-scale", "nan"], "--init-scale"),
    (["--max-scale", "1024"], "--max-scale"),
  ],
)
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
  assert bytes(args.train[:2]) == "é".encode()
