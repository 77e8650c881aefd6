"""Presets and configuration: from_config with dicts and YAML files, unknown keys, preset values."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import optax_dls
from optax_dls import config as _config
from optax_dls._policies.base import GradStats

YAML = """
model: {d_model: 512}          # other sections are left alone
loss_scale:
  init_scale: 4096
  growth_interval: 100
  warmup_steps: 50
"""


def _trajectory(policy, finite):
  """Scales a policy produces for a finite / non-finite sequence (eager, no compilation)."""
  scale, state = policy.init()
  out = []
  for i, f in enumerate(finite):
    stats = GradStats(
      finite=jnp.asarray(f), step=jnp.asarray(i, jnp.int32), grad_norm=jnp.float32(1.0)
    )
    scale, state = policy.update(scale, state, stats)
    out.append(float(scale))
  return out


FINITE = np.random.default_rng(0).random(400) > 0.02


def test_yaml_file_gives_the_same_policy_as_the_arguments(tmp_path):
  path = tmp_path / "train.yaml"
  path.write_text(YAML)
  policy = optax_dls.config.from_config(path)
  expected = optax_dls.dynamic_policy(init_scale=4096, growth_interval=100, warmup_steps=50)
  assert _trajectory(policy, FINITE) == _trajectory(expected, FINITE)
  assert float(policy.init()[0]) == 4096


def test_with_inner_gives_a_transformation_with_wrapper_options():
  cfg = {
    "loss_scale": {
      "init_scale": 512,
      "underflow_stats": True,
      "fallback_after": 10,
      "fallback_steps": 5,
      "skip_lowering": "where",
    }
  }
  tx = optax_dls.config.from_config(cfg, optax.sgd(0.1))
  state = tx.init({"w": jnp.ones(2)})
  m = optax_dls.metrics(state)
  assert float(m["loss_scale"]) == 512 and {
    "underflow/zero_frac",
    "underflow/subnormal_frac",
  } <= set(m)
  assert int(optax.tree_utils.tree_get(state, "steps_left")) == 0  # the fp32_fallback wrapper
  for _ in range(10):
    _, state = tx.update({"w": jnp.full(2, jnp.inf)}, state)
  assert bool(optax_dls.metrics(state)["fp32_fallback"])  # on after 10 consecutive skips


@pytest.mark.parametrize("key", ["alerts", "alert_after"])
def test_alerts_are_not_configured_in_the_transformation(key):
  with pytest.raises(ValueError, match=f"'{key}'.*SkipAlerts"):
    optax_dls.config.from_config({key: 3}, optax.sgd(0.1))


def test_preset_with_override():
  policy = optax_dls.config.from_config({"preset": "qlora", "growth_interval": 10})
  expected = optax_dls.config.preset("qlora", growth_interval=10)
  assert _trajectory(policy, FINITE) == _trajectory(expected, FINITE)


@pytest.mark.parametrize(
  "cfg, key",
  [
    ({"loss_scale": {"init_scale": 8, "growth_intervall": 3}}, "growth_intervall"),
    ({"kind": "static", "scale": 8, "init_scale": 8}, "init_scale"),
    ({"kind": "none", "scale": 8}, "scale"),
    ({"axis_name": "data"}, "axis_name"),  # a transformation option without inner
  ],
)
def test_unknown_or_misplaced_key_is_named(cfg, key):
  with pytest.raises(ValueError, match=f"'{key}'"):
    optax_dls.config.from_config(cfg)


def test_bad_values_and_kinds():
  with pytest.raises(ValueError, match="kind"):
    optax_dls.config.from_config({"kind": "adaptive"})
  with pytest.raises(ValueError, match="preset"):
    optax_dls.config.from_config({"preset": "vision"})
  with pytest.raises(ValueError, match="growth_interval"):
    optax_dls.config.from_config({"growth_interval": 0})
  with pytest.raises(ValueError, match="scale"):
    optax_dls.config.from_config({"kind": "static"})


def test_static_and_none_kinds():
  assert float(optax_dls.config.from_config({"kind": "static", "scale": 128}).init()[0]) == 128
  tx = optax_dls.config.from_config({"kind": "none"}, optax.sgd(1.0))
  updates, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
  assert np.allclose(updates["w"], -1.0)


def test_preset_values_follow_their_rationale():
  llm, mm, pref, qlora = (
    optax_dls.config.preset(n) for n in ("text_llm", "multimodal", "preference", "qlora")
  )
  assert 2**15 <= float(llm.init()[0]) <= 2**16
  assert 2**12 <= float(mm.init()[0]) <= 2**14 and "warmup_steps=1000" in repr(mm)
  assert pref.max_scale == 65536 and repr(optax_dls.config.preset("dpo")) == repr(pref)
  assert float(qlora.init()[0]) >= 2**16 and "growth_interval=1000" in repr(qlora)
  for p in (llm, mm, pref, qlora):
    optax_dls.loss_scaled(optax.sgd(0.1), p)  # every preset is valid


def test_loss_scale_keys_beside_a_loss_scale_section_are_refused():
  with pytest.raises(ValueError, match=r"top level.*\['growth_interval', 'init_scale'\]"):
    optax_dls.config.from_config(
      {"loss_scale": {}, "init_scale": 8.0, "growth_interval": 3, "model": {}}
    )
  # Other sections are still left alone.
  policy = optax_dls.config.from_config({"loss_scale": {"init_scale": 8.0}, "model": {"d": 1}})
  assert float(policy.init()[0]) == 8.0


@pytest.mark.parametrize(
  "text, match",
  [
    ("loss_scale:\n  init_scale: 8.0\n  init_scale: 16.0\n", "duplicate key 'init_scale'"),
    ("loss_scale: {init_scale: [1, 2\n", "not valid YAML"),
  ],
)
def test_bad_yaml_files_raise_value_error_naming_the_file(tmp_path, text, match):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(ValueError, match=match) as e:
    optax_dls.config.from_config(str(path))
  assert "bad.yaml" in str(e.value)


def test_binary_yaml_file_raises_value_error(tmp_path):
  path = tmp_path / "bin.yaml"
  path.write_bytes(bytes(range(128, 256)))
  with pytest.raises(ValueError, match="bin.yaml.*UTF-8"):
    optax_dls.config.from_config(path)


def test_scientific_number_read_as_string_gets_a_hint(tmp_path):
  path = tmp_path / "sci.yaml"
  path.write_text("loss_scale:\n  init_scale: 1e4\n")
  with pytest.raises(TypeError, match=r"init_scale.*'1e4'.*1\.0e4"):
    optax_dls.config.from_config(path)


SAFE_LOAD_DOCUMENTS = [
  # Merge keys: one anchor, a list of anchors, an override of a merged key.
  (
    "defaults: &d {init_scale: 8.0, growth_interval: 3}\n"
    "loss_scale:\n  <<: *d\n  growth_interval: 5\n"
  ),
  "a: &a {x: 1}\nb: &b {y: 2, x: 3}\nc:\n  <<: [*a, *b]\n  z: 4\n",
  "base: &base\n  hysteresis: 2\nruns:\n  - <<: *base\n    init_scale: 4.0\n  - <<: *base\n",
  # Other safe tags and styles.
  "s: !!set {a, b}\nd: 2024-01-02\nb: !!binary aGk=\no: !!omap [{a: 1}, {b: 2}]\n",
  "? complex key\n: 1\nnull: ~\n1: one\n2.5: two\n",
  "--- {a: [1, 2, {b: c}]}\n",
]


@pytest.mark.parametrize("text", SAFE_LOAD_DOCUMENTS)
def test_a_yaml_file_is_read_as_yaml_safe_load_reads_it(tmp_path, text):
  path = tmp_path / "c.yaml"
  path.write_text(text)
  assert _config._load_config(path) == yaml.safe_load(text)  # what from_config(path) reads


def test_merge_key_config_builds_the_merged_policy(tmp_path):
  path = tmp_path / "train.yaml"
  path.write_text(SAFE_LOAD_DOCUMENTS[0])
  expected = optax_dls.dynamic_policy(init_scale=8.0, growth_interval=5)
  assert _trajectory(optax_dls.config.from_config(path), FINITE) == _trajectory(expected, FINITE)


@pytest.mark.parametrize(
  "text, match",
  [
    ("a: &a {x: 1, x: 2}\nb: {<<: *a}\n", "duplicate key 'x'"),  # inside the anchor
    ("a: &a {x: 1}\nb:\n  <<: *a\n  y: 1\n  y: 2\n", "duplicate key 'y'"),  # beside a merge
    ("? [a, b]\n: 1\n", "unhashable key"),
    ("? {a: 1}\n: 1\n", "unhashable key"),
    ("a: !!python/object/apply:os.system [echo hi]\n", "python/object"),
    ("a: !!python/name:os.system\n", "python/name"),
    ("a: !!python/tuple [1, 2]\n", "python/tuple"),
  ],
)
def test_what_safe_load_refuses_or_a_repeated_key_raises_value_error_naming_the_file(
  tmp_path, text, match
):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(ValueError, match=match) as e:
    optax_dls.config.from_config(path)
  assert "bad.yaml" in str(e.value)


@pytest.mark.parametrize("path", [None, 3, b"c.yaml"])
def test_a_config_must_be_a_mapping_or_a_str_or_path(path):
  with pytest.raises(TypeError, match="path"):
    optax_dls.config.from_config(path)


def test_a_preset_s_repr_is_one_line_naming_the_preset_and_its_settings():
  torch = repr(optax_dls.config.preset("torch", growth_interval=5))
  assert torch == (
    "LossScalePolicy(preset='torch', init_scale=2**16, min_scale=2**-126, max_scale=2**126, "
    "growth_factor=2.0, growth_interval=5, backoff_factor=0.5)"
  )
  llm = repr(optax_dls.config.preset("llm"))
  assert llm.startswith("LossScalePolicy(preset='text_llm', init_scale=2**16,") and "\n" not in llm
  # The same form as a dynamic policy's, without the name.
  assert repr(optax_dls.dynamic_policy(init_scale=8.0, hysteresis=2)) == (
    "LossScalePolicy(init_scale=8.0, min_scale=1.0, max_scale=2**24, growth_factor=2.0, "
    "growth_interval=2000, backoff_factor=0.5, hysteresis=2)"
  )


@pytest.mark.parametrize("name", ["text_llm", "multimodal", "preference", "qlora", "torch"])
def test_a_preset_s_repr_names_dynamic_policy_s_arguments(name):
  """The settings a preset's repr shows, copied into dynamic_policy, make the same rule."""
  policy = optax_dls.config.preset(name)
  text = repr(policy).removeprefix("LossScalePolicy(").removesuffix(")")
  kwargs = dict(item.split("=", 1) for item in text.split(", ") if not item.startswith("preset"))
  rebuilt = optax_dls.dynamic_policy(**{k: eval(v) for k, v in kwargs.items()})
  assert repr(rebuilt) == repr(policy._replace(preset=None))
