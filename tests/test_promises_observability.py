"""docs/observability.md: its snippets run in order and print what their comments say,
and the metrics table gives each key's dtype and shape."""

import ast
import contextlib
import io
import json
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls._logs.report import inspect

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "observability.md"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
  """Runs the page's ```python blocks in one namespace; returns ``(namespace, outputs)``,
  the printed text of each block."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("observability")))
    return _run_blocks()


def _run_blocks():
  blocks = re.findall(r"^```python\n(.*?)^```\s*$", PAGE.read_text(), re.DOTALL | re.MULTILINE)
  namespace, outputs = {"__name__": "docs_observability"}, []
  for i, block in enumerate(blocks):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = compile(block, f"docs/observability.md (block {i})", "exec", dont_inherit=True)
      exec(code, namespace)  # noqa: S102
    outputs.append(out.getvalue())
  return namespace, outputs


def test_the_snippets_run_and_print_what_the_page_says(page):
  ns, out = page
  assert out[0].split() == ["32768.0", "0"]  # the recipe: a new state's metrics
  composed = out[1].splitlines()
  assert composed[0] == (
    "[(16.0, False, False), (8.0, True, False), (4.0, True, False), (2.0, True, True), "
    "(2.0, False, True), (2.0, False, True), (2.0, False, True), (2.0, False, True), "
    "(16.0, False, False)]"
  )
  assert composed[1] == "3 optax_dls: loss scale stuck at its minimum 1"
  assert composed[2] == "1.0 0.0"  # lora subnormal, base not
  # "the first alert fires at step 12"; "the skip at step 28 ... raises the stuck alert"
  assert "at step 12;" in ns["alerts"].fired[0]
  assert "step 28 was non-finite" in ns["alerts"].fired[-1]
  assert out[2].split() == ["0.625", "1.0", "0.125", "0.25"]  # underflow statistics
  assert out[4].split() == ["False", "inf"]  # lax.cond on the fp32_fallback flag: float16 ran
  assert "stuck at the minimum" in out[6]  # optax-dls inspect of the logged run
  keys = ast.literal_eval(out[7].splitlines()[0])  # the printed sorted list of metric keys
  assert {"fp32_fallback", "underflow/zero_frac"} <= set(keys)
  assert "SkipAlerts(alert_after=...)" in out[7].splitlines()[1]


def test_the_fractions_are_those_of_the_last_applied_step_23(page):
  ns, _ = page
  history = ns["history"]
  applied = [step for step, (_, skipped, _) in enumerate(history) if not skipped]
  assert applied[-1] == 23 and all(history[s][1] for s in range(24, 30))


def _table_rows():
  """``(keys cell, dtype, " `[W]`" or "")`` of each row of the Metrics table."""
  return re.findall(r"^\| `([^|]+)` \| (\w+)( `\[W\]`)? \|", PAGE.read_text(), re.MULTILINE)


DTYPES = {"f32": np.float32, "i32": np.int32, "u32": np.uint32, "bool": np.bool_}


def test_every_metric_of_the_table_has_its_dtype_and_shape():
  """All 0-d but the two bit sets ``[W]``, each with the dtype the table gives."""
  labels = {"base": "base", "lora": "lora"}
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy())
  inner = optax.chain(
    optax_dls.underflow_stats(labels), optax_dls.recompute_stats(), optax.sgd(1.0)
  )
  tx = optax_dls.loss_scaled(inner, policy, labels=labels)
  params = {"base": jnp.zeros(3), "lora": jnp.zeros(2)}
  state = tx.init(params)
  _, state = tx.update({"base": jnp.ones(3), "lora": jnp.full(2, jnp.inf)}, state, params)
  m = optax_dls.metrics(state)
  rows = _table_rows()
  assert len(rows) >= 16, rows
  seen = set()
  for cell, dtype, bitset in rows:
    for key in re.findall(r"[\w/<>]+", cell.replace("`, `", " ")):
      names = [key.replace("<label>", label) for label in labels] if "<label>" in key else [key]
      for name in names:
        assert name in m, name
        value = np.asarray(m[name])
        assert value.dtype == DTYPES[dtype], (name, value.dtype)
        assert value.ndim == (1 if bitset else 0), (name, value.shape)
        seen.add(name)
  assert seen == set(m), set(m) ^ seen  # the table lists every key, and no other
  assert int(m["overflows/lora"]) == 1 and int(m["overflows/base"]) == 0
  applied = int(m["num_steps"]) - int(m["skip_count"])  # "reached the inner optimizer"
  assert applied == 0


@pytest.mark.parametrize("key", ["alerts", "alert_after"])
def test_alert_keys_are_refused_naming_skip_alerts(key):
  with pytest.raises(ValueError, match=r"SkipAlerts\(alert_after=\.\.\.\)"):
    optax_dls.config.from_config({key: 3})


def _pinned(tmp_path, name, scales, skips=0):
  with optax_dls.writers.MetricsWriter(tmp_path / name, tensorboard=False) as w:
    for i, scale in enumerate(scales):
      skip_count = skips if i == len(scales) - 1 else 0
      w.log(i, {"loss_scale": scale, "skip_count": skip_count, "num_steps": i + 1, "loss": 1.0})
  found = inspect(str(tmp_path / name))
  return "scale pinned" in found


def test_scale_pinned_is_most_rows_at_the_highest_scale_of_2_to_the_24_or_more_without_a_skip(
  tmp_path,
):
  """The table's "scale pinned" row, and troubleshooting.md's "Gradients always small"."""
  assert _pinned(tmp_path, "pinned", [2.0**24] * 60)
  assert not _pinned(tmp_path, "lower", [2.0**23] * 60)  # below 2**24
  assert not _pinned(tmp_path, "skipped", [2.0**24] * 60, skips=1)  # a skip
  assert _pinned(tmp_path, "half", [2.0**20] * 29 + [2.0**25] * 31)  # more than half at the top
  assert not _pinned(tmp_path, "spread", [2.0**24] * 20 + [2.0**25] * 20 + [2.0**26] * 20)


PRESETS = {  # the Presets table
  "text_llm": {"init_scale": 2.0**16, "growth_interval": 1000, "hysteresis": 2},
  "multimodal": {
    "init_scale": 2.0**13,
    "growth_interval": 1000,
    "warmup_steps": 1000,
    "hysteresis": 2,
  },
  "preference": {
    "init_scale": 2.0**15,
    "max_scale": 65536.0,
    "growth_interval": 1000,
    "hysteresis": 2,
  },
  "qlora": {"init_scale": 2.0**16, "growth_interval": 1000, "max_scale": 2.0**24},
}


def test_each_preset_is_the_dynamic_policy_of_the_values_of_the_table():
  # The same rule: every field of it shows (the preset's name aside).
  same = lambda a, b: repr(a._replace(preset=None)) == repr(b)
  for name, values in PRESETS.items():
    assert same(optax_dls.config.preset(name), optax_dls.dynamic_policy(**values))
  assert same(optax_dls.config.preset("dpo"), optax_dls.dynamic_policy(**PRESETS["preference"]))


def test_fallback_keys_wrap_the_policy_and_the_last_two_need_the_first():
  policy = optax_dls.config.from_config(
    {"init_scale": 8.0, "fallback_after": 2, "fallback_steps": 3, "fallback_scale": 4.0}
  )
  expected = optax_dls.fp32_fallback(
    optax_dls.dynamic_policy(init_scale=8.0), after=2, steps=3, scale=4.0
  )
  tx, hand = (
    optax_dls.loss_scaled(optax.sgd(1.0), policy),
    optax_dls.loss_scaled(optax.sgd(1.0), expected),
  )
  params = {"w": jnp.ones(2)}
  s, h = tx.init(params), hand.init(params)
  for g in [jnp.inf, jnp.inf, 1.0, 1.0, 1.0, 1.0]:
    _, s = tx.update({"w": jnp.full(2, g)}, s, params)
    _, h = hand.update({"w": jnp.full(2, g)}, h, params)
    ms, mh = optax_dls.metrics(s), optax_dls.metrics(h)
    assert (float(ms["loss_scale"]), bool(ms["fp32_fallback"])) == (
      float(mh["loss_scale"]),
      bool(mh["fp32_fallback"]),
    )
  for key in ("fallback_steps", "fallback_scale"):
    with pytest.raises(ValueError, match=f"'{key}'.*need fallback_after"):
      optax_dls.config.from_config({key: 4})


def test_metrics_are_device_arrays_read_without_a_transfer_to_the_host():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0))
  state = tx.init({"w": jnp.ones(2)})
  with jax.transfer_guard_device_to_host("disallow"):
    m = optax_dls.metrics(state)
  assert all(isinstance(v, jax.Array) for v in m.values())
  assert int(m["num_steps"]) - int(m["skip_count"]) == 0


def test_the_composed_step_holds_no_host_callback_and_counts_the_inner_updates(page):
  """ "none of them puts a host callback into the jitted step"; the updates that reached the
  inner optimizer are ``num_steps - skip_count``."""
  ns, _ = page
  jaxpr = str(jax.make_jaxpr(ns["train_step"])(ns["params"], ns["opt_state"], *ns["batch"](0)))
  assert "callback" not in jaxpr
  adam = [
    s
    for s in jax.tree.leaves(
      ns["opt_state"].inner_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ]
  m = optax_dls.metrics(ns["opt_state"])
  assert int(adam[0].count) == int(m["num_steps"]) - int(m["skip_count"]) == 21


def _rows(steps, **extra):
  return [
    {"step": i, "loss_scale": 2.0**10, "skip_count": 0, "num_steps": i + 1} | extra for i in steps
  ]


def _write_jsonl(path, rows):
  path.mkdir(parents=True, exist_ok=True)
  with open(path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_rows_without_loss_scale_keys_are_ignored_and_runs_are_told_apart_by_run(tmp_path):
  """ "rows without loss-scale keys, such as validation rows, are ignored"; "Runs are told
  apart by the `run` key, else by folder"."""
  rows = _rows(range(4), run="a") + [{"step": 4, "run": "a", "val_loss": 1.0}]
  _write_jsonl(tmp_path / "one", rows + _rows(range(6), run="b"))
  _write_jsonl(tmp_path / "two", _rows(range(3)))
  report = json.loads(inspect(str(tmp_path), as_json=True))
  assert {name: r["summary"]["updates"] for name, r in report.items()} == {"a": 4, "b": 6, "two": 3}


def test_tensorboard_tags_are_matched_by_their_last_component(tmp_path):
  tensorboardX = pytest.importorskip("tensorboardX")
  pytest.importorskip("tensorboard")
  writer = tensorboardX.SummaryWriter(str(tmp_path / "tb"))
  for step in range(5):
    writer.add_scalar("train/loss_scale", 2.0**10, step)
    writer.add_scalar("train/skip_count", 0, step)
    writer.add_scalar("train/num_steps", step + 1, step)
  writer.close()
  report = json.loads(inspect(str(tmp_path), as_json=True))
  (summary,) = [r["summary"] for r in report.values()]
  assert summary["updates"] == 5 and summary["scale_max"] == 2.0**10


def test_the_json_report_has_the_keys_the_page_lists(tmp_path):
  """`--json`: `updates`, `applied_updates`, `skips`, and, where the logs carry them,
  `overflows_by_group` and `nonfinite` with `by_parameter`, `loss_steps` and `last`."""
  labels = {"a": "a", "b": "b"}
  tx = optax_dls.loss_scaled(optax.sgd(1.0), optax_dls.dynamic_policy(), labels=labels)
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  state = tx.init(params)
  with optax_dls.writers.MetricsWriter(tmp_path, tensorboard=False, params=params) as w:
    for i in range(4):
      grads = {"a": jnp.full(2, jnp.inf if i == 1 else 1.0), "b": jnp.ones(2)}
      _, state = tx.update(grads, state, params)
      w.log(i, optax_dls.metrics(state))
  (run,) = json.loads(inspect(str(tmp_path), as_json=True)).values()
  summary = run["summary"]
  assert (summary["updates"], summary["applied_updates"], summary["skips"]) == (4, 3, 1)
  assert summary["overflows_by_group"] == {"a": 1, "b": 0}
  assert {"by_parameter", "loss_steps", "last"} <= set(summary["nonfinite"])
  assert summary["nonfinite"]["last"]["leaves"] == {"a": "inf"}


def test_each_alerts_call_returns_what_it_logged_and_fired_keeps_it_all(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**4)
  params = {"w": jnp.ones(2)}
  state, alerts, returned = tx.init(params), optax_dls.SkipAlerts(alert_after=2), []
  with caplog.at_level("WARNING", logger="optax_dls"):
    for step, g in enumerate([jnp.inf, jnp.inf, jnp.inf, 1.0, jnp.inf, jnp.inf]):
      _, state = tx.update({"w": jnp.full(2, g)}, state, params)
      returned.append(alerts(step, optax_dls.metrics(state)))
  logged = [r.getMessage() for r in caplog.records if r.name == "optax_dls"]
  assert [len(r) for r in returned] == [0, 1, 0, 0, 0, 1]  # once per run of skips
  assert [m for r in returned for m in r] == logged == alerts.fired
