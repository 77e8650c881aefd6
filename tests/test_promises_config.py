"""The promises of the ``optax_dls.config`` docstrings not held elsewhere."""

from __future__ import annotations

import textwrap

import optax
import pytest

import optax_dls
from optax_dls import config


def test_every_alias_names_its_preset_and_an_unknown_name_lists_the_known_ones():
  aliases = {"llm": "text_llm", "dpo": "preference", "alignment": "preference", "lora": "qlora"}
  for alias, name in aliases.items():
    assert repr(config.preset(alias)) == repr(config.preset(name))
  with pytest.raises(ValueError, match="known presets.*'torch'.*'multimodal'"):
    config.preset("vision")


def test_preset_kwargs_override_and_unknown_ones_are_named():
  """``preset(name, **kwargs)``: a kind of training takes dynamic_policy's arguments, a
  framework its own names; anything else is a TypeError naming what it takes."""
  assert repr(config.preset("qlora", growth_interval=10)._replace(preset=None)) == repr(
    optax_dls.dynamic_policy(init_scale=2.0**16, growth_interval=10, max_scale=2.0**24)
  )
  assert float(config.preset("keras", initial_scale=8.0).init()[0]) == 8.0
  with pytest.raises(TypeError, match="'torch' takes no argument 'initial_scale'.*init_scale"):
    config.preset("torch", initial_scale=8.0)
  with pytest.raises(TypeError, match="'jmp' needs loss_scale"):
    config.preset("jmp")


def test_a_framework_preset_in_a_configuration_takes_its_own_names():
  policy = config.from_config({"preset": "keras", "initial_scale": 8.0, "fallback_after": 3})
  assert float(policy.init()[0]) == 8.0
  with pytest.raises(ValueError, match="'init_scale' for kind='dynamic' with preset='keras'"):
    config.from_config({"preset": "keras", "init_scale": 8.0})


def test_a_fallback_key_without_fallback_after_is_refused():
  with pytest.raises(ValueError, match=r"\['fallback_steps'\] need fallback_after"):
    config.from_config({"fallback_steps": 3}, optax.sgd(1.0))


def test_static_takes_two_fallback_keys_and_none_takes_none():
  policy = config.from_config(
    {"kind": "static", "scale": 8, "fallback_after": 3, "fallback_steps": 2}
  )
  assert float(policy.init()[0]) == 8.0
  with pytest.raises(ValueError, match="'fallback_scale' for kind='static'"):
    config.from_config({"kind": "static", "scale": 8, "fallback_after": 3, "fallback_scale": 2})
  with pytest.raises(ValueError, match="'fallback_after' for kind='none'"):
    config.from_config({"kind": "none", "fallback_after": 3})


@pytest.mark.parametrize(
  "cfg, inner, match",
  [
    (3, None, "config must be a mapping or a path"),
    ({"loss_scale": [1]}, None, r"config\['loss_scale'\] must be a mapping"),
    ({"underflow_stats": 1}, optax.sgd(1.0), "underflow_stats in a configuration must be a bool"),
    ({"init_scale": "1e4"}, None, r"write 1\.0e\+4"),
  ],
)
def test_a_config_or_value_of_the_wrong_type_raises_type_error(cfg, inner, match):
  with pytest.raises(TypeError, match=match):
    config.from_config(cfg, inner)


def test_an_empty_loss_scale_section_is_the_default_dynamic_policy():
  policy = config.from_config({"loss_scale": None, "model": {"width": 3}})
  assert float(policy.init()[0]) == float(optax_dls.dynamic_policy().init()[0])


def test_the_module_docstring_s_yaml_example_builds_its_policy(tmp_path):
  block = config.__doc__.split("::\n\n", 1)[1].split("\n\n", 1)[0]
  path = tmp_path / "train.yaml"
  path.write_text(textwrap.dedent(block))
  policy = config.from_config(path)
  expected = config.preset("text_llm", init_scale=4096, growth_interval=100, warmup_steps=50)
  assert repr(policy) == repr(expected)  # the same rule: every field of it shows


def test_the_number_hint_s_spelling_is_read_by_yaml_as_a_number(tmp_path):
  """The hint for ``1e4`` says to write ``1.0e+4``: PyYAML reads that as a float."""
  path = tmp_path / "c.yaml"
  path.write_text("loss_scale:\n  init_scale: 1.0e4\n")
  with pytest.raises(TypeError, match=r"write 1\.0e\+4") as e:
    config.from_config(path)
  path.write_text(f"loss_scale:\n  init_scale: {str(e.value).split('write ')[1].split()[0]}\n")
  assert float(config.from_config(path).init()[0]) == 1.0e4


def test_the_number_hint_of_a_whole_number_key_says_to_write_the_integer():
  with pytest.raises(TypeError, match=r"write 10000\.$") as e:
    config.from_config({"growth_interval": "1e3"})
  assert "1.0e+4" not in str(e.value)
