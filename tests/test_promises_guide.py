"""The numbers and rules the guide pages state (why.md, tuning.md, quickstart.md,
training.md, comparison.md), each checked against the code or the library it names."""

import dataclasses
import importlib
import inspect
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _scales_and_skips(tx, scaled_grads, steps):
  """The loss scale after each of ``steps`` updates, and the skips, one compile: each
  step's gradient is ``scaled_grads(S)`` at the scale S the state holds."""
  params = {"w": jnp.zeros(2)}

  def body(state, _):
    grads = {"w": scaled_grads(optax_dls.find_state(state).loss_scale)}
    _, state = tx.update(grads, state, params)
    return state, optax_dls.find_state(state).loss_scale

  state, scales = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(tx.init(params))
  return [float(s) for s in scales], int(optax_dls.metrics(state)["skip_count"])


def test_float16_range_is_the_table_of_why_md():
  f16 = jnp.finfo(jnp.float16)
  assert float(f16.max) == 65504.0
  assert float(f16.smallest_normal) == 2.0**-14
  assert float(f16.smallest_subnormal) == 2.0**-24
  assert float(f16.eps) == 2.0**-10
  # "anything below about 2^-25 underflows to zero"; 2^-24 survives; 60000 * 2 is inf.
  assert float(jnp.asarray(2.0**-25, jnp.float16)) == 0.0
  assert float(jnp.asarray(2.0**-24, jnp.float16)) == 2.0**-24
  assert float(jnp.asarray(2.0**-26, jnp.float16)) == 0.0
  assert bool(jnp.isinf(jnp.asarray(60000.0, jnp.float16) * 2))
  # Float32 and bfloat16 share an 8-bit exponent: about 3.4e38 down to 2^-126 (normal).
  for dtype in (jnp.float32, jnp.bfloat16):
    info = jnp.finfo(dtype)
    assert float(info.smallest_normal) == 2.0**-126
    assert 3.3e38 < float(info.max) < 3.5e38


def test_dynamic_loss_scale_defaults_are_the_documented_ones():
  # why.md:Scaling the loss; tuning.md's table; comparison.md's optax_dls column.
  documented = dict(
    init_scale=2.0**15,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    min_scale=1.0,
    max_scale=2.0**24,
    hysteresis=1,
    consecutive_hysteresis=False,
    warmup_steps=0,
  )
  for fn in (optax_dls.dynamic_loss_scale, optax_dls.dynamic_policy):
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
    assert {k: defaults[k] for k in documented} == documented, fn.__name__


def test_default_rule_backs_off_by_half_grows_on_the_2000th_clean_step_and_stops_at_1():
  # quickstart.md:What happened; why.md:Scaling the loss, steps 1-3.
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  n_bad, n_clean = 1, 2000
  pattern = jnp.asarray([False] * n_bad + [True] * n_clean + [False] * 20)
  params = {"w": jnp.zeros(2)}

  def body(state, ok):
    _, state = tx.update({"w": jnp.where(ok, 1.0, jnp.inf) * jnp.ones(2)}, state, params)
    return state, optax_dls.find_state(state).loss_scale

  state0 = tx.init(params)
  assert float(optax_dls.find_state(state0).loss_scale) == 2.0**15
  _, scales = jax.jit(lambda s: jax.lax.scan(body, s, pattern))(state0)
  scales = np.asarray(scales)
  assert scales[0] == 2.0**14  # one overflow halves S
  assert scales[n_clean - 1] == 2.0**14  # 1999 clean steps: no growth yet
  assert scales[n_clean] == 2.0**15  # the 2000th clean step doubles S
  assert scales[-1] == 1.0 and scales.min() == 1.0  # 20 overflows: S stops at min_scale


def test_five_skips_from_2_15_to_a_working_2_10_then_one_skip_per_probe():
  # tuning.md: "from 2^15 down to a working 2^10 is five skipped batches, once, at the
  # start", and "at equilibrium a run skips about one step per growth_interval steps"
  # (exactly one in growth_interval + 1: the probe's overflow). A float16 gradient of 40
  # fits at S = 2^10 (40960) and overflows at 2^11 (81920).
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=10)
  grads = lambda s: (40.0 * s * jnp.ones(2)).astype(jnp.float16)
  scales, skips = _scales_and_skips(tx, grads, 5 + 11 * 10)
  assert scales[:5] == [2.0**14, 2.0**13, 2.0**12, 2.0**11, 2.0**10]
  assert skips == 5 + 10
  assert max(scales[5:]) == 2.0**11 and min(scales[5:]) == 2.0**10


def test_preset_table_of_tuning_md():
  table = (DOCS / "guide" / "tuning.md").read_text().split("## Presets")[1]
  words = {"init": "init_scale", "interval": "growth_interval", "hysteresis": "hysteresis"}
  words |= {"warm-up": "warmup_steps", "max": "max_scale"}
  rows = re.findall(r"^\| `(\w+)`(?: \(alias `(\w+)`\))? \| ([^|]+) \|", table, re.MULTILINE)
  assert {r[0] for r in rows} == {"text_llm", "multimodal", "preference", "qlora"}
  for name, alias, values in rows:
    stated = {}
    for item in values.split(", "):
      word, value = item.rsplit(" ", 1)
      stated[words[word]] = float(2 ** int(value[2:])) if value.startswith("2^") else int(value)
    preset = repr(optax_dls.config.preset(name)._replace(preset=None))  # the rule, not the name
    assert preset == repr(optax_dls.dynamic_policy(**stated)), name
    if alias:
      assert repr(optax_dls.config.preset(alias)._replace(preset=None)) == preset


def test_growth_interval_counts_micro_batches_under_multisteps():
  # training.md:Gradient accumulation: growth_interval, num_steps and skip_count count
  # micro-batches; growth after N clean windows of k takes growth_interval = N * k.
  k, n_windows = 4, 2
  inner = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k)
  tx = optax_dls.dynamic_loss_scale(inner, init_scale=8.0, growth_interval=n_windows * k)
  scales, skips = _scales_and_skips(tx, lambda s: s * jnp.ones(2), n_windows * k)
  assert scales == [8.0] * (n_windows * k - 1) + [16.0] and skips == 0
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert int(optax_dls.metrics(state)["num_steps"]) == 3  # micro-batches, not windows


def test_clipping_outside_the_loss_scaling_has_the_threshold_divided_by_s():
  # training.md:Gradient clipping: chain(clip(1.0), loss scaling) clips S * g at 1.0, which
  # is g clipped at 1.0 / S.
  scale, grads = 2.0**10, {"w": jnp.array([3.0, 4.0])}  # |g| = 5
  outside = optax.chain(
    optax.clip_by_global_norm(1.0), optax_dls.static_loss_scale(optax.sgd(1.0), scale)
  )
  params = {"w": jnp.zeros(2)}
  got, _ = outside.update(jax.tree.map(lambda g: g * scale, grads), outside.init(params), params)
  reference = optax.chain(optax.clip_by_global_norm(1.0 / scale), optax.sgd(1.0))
  expected, _ = reference.update(grads, reference.init(params), params)
  np.testing.assert_allclose(got["w"], expected["w"], rtol=1e-6)
  assert float(jnp.linalg.norm(got["w"])) == pytest.approx(1.0 / scale, rel=1e-6)


def _comparison_rows():
  """comparison.md's first table: {row label: {column: cell}}."""
  text = (DOCS / "guide" / "comparison.md").read_text()
  lines = [line for line in text.splitlines() if line.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  rows = {}
  for line in lines[2:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) != len(header):
      break
    rows[cells[0]] = dict(zip(header[1:], cells[1:]))
  return rows


def _power(cell):
  """``2^15`` -> 32768.0; ``required`` -> None; ``2000 (`period`)`` -> 2000."""
  cell = cell.split(" ")[0]
  if cell == "required":
    return None
  return float(2 ** int(cell[2:])) if cell.startswith("2^") else float(cell)


def test_comparison_table_defaults_are_each_library_s_own():
  # comparison.md: the initial scale and growth interval of each library, read from the
  # libraries installed (DeepSpeed and mpx are not: their columns are from their sources).
  rows = _comparison_rows()
  init, interval = rows["initial scale"], rows["growth interval"]

  def defaults(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()}

  ours = defaults(optax_dls.dynamic_loss_scale)
  assert (_power(init["`optax_dls`"]), _power(interval["`optax_dls`"])) == (
    ours["init_scale"],
    ours["growth_interval"],
  )
  assert rows["floor"]["`optax_dls`"] == f"`min_scale` = {ours['min_scale']:g}"
  assert rows["hysteresis"]["`optax_dls`"].startswith(f"`hysteresis` = {ours['hysteresis']}")
  checked = []
  torch = _optional("torch")
  if torch is not None:
    d = defaults(torch.amp.GradScaler)
    assert (d["init_scale"], d["growth_interval"]) == (
      _power(init["PyTorch `GradScaler`"]),
      _power(interval["PyTorch `GradScaler`"]),
    )
    checked.append("torch")
  jmp = _optional("jmp")
  if jmp is not None:
    d = defaults(jmp.DynamicLossScale)
    assert (
      d["loss_scale"] is inspect.Parameter.empty and _power(init["jmp `DynamicLossScale`"]) is None
    )
    assert d["period"] == _power(interval["jmp `DynamicLossScale`"])
    floor = jmp.DynamicLossScale.__dataclass_fields__["min_loss_scale"].default_factory()
    assert float(floor) == float(rows["floor"]["jmp `DynamicLossScale`"])
    checked.append("jmp")
  flax_scale = _optional("flax.training.dynamic_scale")
  if flax_scale is not None:
    d = defaults(flax_scale.DynamicScale)
    column = "flax `DynamicScale`"
    assert (d["scale"], d["growth_interval"]) == (_power(init[column]), _power(interval[column]))
    assert (
      d["minimum_scale"] == np.finfo(np.float32).tiny and rows["floor"][column] == "float32 tiny"
    )
    checked.append("flax")
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = _optional("keras")
  if keras is not None:
    d = defaults(keras.optimizers.LossScaleOptimizer)
    column = "Keras 3 `LossScaleOptimizer`"
    assert (d["initial_scale"], d["dynamic_growth_steps"]) == (
      _power(init[column]),
      _power(interval[column]),
    )
    checked.append("keras")
  megatron = _optional("megatron.core.optimizer")
  if megatron is not None:
    d = {f.name: f.default for f in dataclasses.fields(megatron.OptimizerConfig)}
    assert (d["initial_loss_scale"], d["loss_scale_window"]) == (
      _power(init["Megatron-LM"]),
      _power(interval["Megatron-LM"]),
    )
    assert d["min_loss_scale"] == float(rows["floor"]["Megatron-LM"])
    assert rows["hysteresis"]["Megatron-LM"].startswith(f"{d['hysteresis']}, ")
    checked.append("megatron")
  if not checked:
    pytest.skip("none of the compared libraries is installed")


def _optional(name):
  try:
    return importlib.import_module(name)
  except Exception:  # noqa: BLE001 - not installed, or not importable here
    return None


def test_static_loss_scale_keeps_its_scale_and_still_skips_non_finite_steps():
  # quickstart.md:The other constructors.
  tx = optax_dls.static_loss_scale(optax.sgd(1.0), 2.0**8)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, state = update({"w": jnp.array([2.0**8, jnp.inf])}, state, params)
  assert bool(optax_dls.metrics(state)["skipped"])
  assert bytes(np.asarray(optax.apply_updates(params, updates)["w"])) == bytes(
    np.ones(2, np.float32)
  )
  updates, state = update({"w": jnp.full(2, 2.0**8)}, state, params)
  np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])
  assert (
    float(optax_dls.find_state(state).loss_scale) == 2.0**8
    and int(optax_dls.metrics(state)["skip_count"]) == 1
  )


class _Parsed(Exception):
  """Raised with the parsed arguments in place of running a benchmark."""


def _benchmark_commands():
  """Every ``python benchmarks/NAME.py ARGS`` that README.md, the performance guide and the
  design name, and every ``--flag VALUE ...`` given after it in the text, for the script named
  last (a bare ``--flag`` elsewhere belongs to other commands, such as ``optax-dls inspect``)."""
  commands, last = [], None
  for page in (DOCS.parent / "README.md", DOCS / "guide" / "performance.md", DOCS / "design.md"):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    for span in re.findall(r"`([^`]+)`", text):
      span = " ".join(span.split())
      found = re.match(r"(?:python )?benchmarks/(\w+)\.py((?: --?[\w-]+(?: [\w,.]+)?)*)$", span)
      if found:
        last = found.group(1)
        commands.append((last, found.group(2).split()))
      elif span.startswith("--") and " " in span and last is not None:  # flags with values
        commands.append((last, span.split()))
  return commands


def test_the_benchmark_commands_the_docs_name_parse_and_name_real_variants(monkeypatch):
  # Every number of README.md:Performance and performance.md comes from one of these.
  import argparse
  import importlib.util

  commands = _benchmark_commands()
  assert {name for name, _ in commands} >= {"step_overhead", "train_step_e2e", "gpu_check"}
  assert ("step_overhead", ["--fresh-compile"]) in commands
  parse = argparse.ArgumentParser.parse_args

  def parse_and_stop(self, args=None, namespace=None):
    raise _Parsed(parse(self, args, namespace))

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
  modules = {}
  for name, argv in commands:
    if name not in modules:
      spec = importlib.util.spec_from_file_location(name, DOCS.parent / "benchmarks" / f"{name}.py")
      modules[name] = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(modules[name])
    with pytest.raises(_Parsed) as parsed:
      modules[name].main(argv)
    args = parsed.value.args[0]
    if getattr(args, "variants", None):
      groups = getattr(modules[name], "GROUPS", {})  # a named group of variants
      unknown = set(args.variants.split(",")) - set(modules[name].VARIANTS) - set(groups)
      assert not unknown, f"{name} {argv}: no such variant {unknown}"
