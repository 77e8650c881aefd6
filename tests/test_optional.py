"""A missing optional dependency is one ImportError that names the extra installing it."""

import importlib
import pathlib
import re
import sys
import tomllib

import jax.numpy as jnp
import optax
import pytest

import optax_dls
from optax_dls import checkpoint, config
from optax_dls._util import optional as _optional

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _without(monkeypatch, *modules):
  """Makes ``import`` of each of ``modules`` fail, as when the package is not installed."""
  for name in modules:
    monkeypatch.setitem(sys.modules, name, None)


def _one_line(error):
  text = str(error.value)
  assert "\n" not in text, text
  return text


def test_optax_dls_flax_without_flax_names_the_flax_extra(monkeypatch):
  _without(monkeypatch, "flax", "flax.nnx")
  monkeypatch.delitem(sys.modules, "optax_dls.flax", raising=False)
  with pytest.raises(ImportError) as e:
    importlib.import_module("optax_dls.flax")
  assert isinstance(e.value, _optional.MissingExtraError)
  assert 'pip install -e ".[flax]"' in _one_line(e)


def test_a_yaml_configuration_without_pyyaml_names_the_monitoring_extra(tmp_path, monkeypatch):
  path = tmp_path / "c.yaml"
  path.write_text("loss_scale:\n  init_scale: 1024\n")
  _without(monkeypatch, "yaml")
  with pytest.raises(ImportError) as e:
    config.from_config(path)
  text = _one_line(e)
  assert "PyYAML" in text and 'pip install -e ".[monitoring]"' in text


def test_restore_without_orbax_names_the_checkpoint_extra(monkeypatch):
  params = {"w": jnp.ones(2)}
  target = optax_dls.dynamic_loss_scale(optax.sgd(1.0)).init(params)
  _without(monkeypatch, "orbax", "orbax.checkpoint")
  with pytest.raises(ImportError) as e:
    checkpoint.restore(object(), target)
  text = _one_line(e)
  assert "pip install orbax-checkpoint" in text and 'pip install -e ".[checkpoint]"' in text


def test_every_named_extra_is_declared_and_brings_its_package():
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  for module, (package, extra) in _optional.PACKAGES.items():
    assert extra in extras, (module, extra)
    names = {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower() for req in extras[extra]}
    assert package.lower() in names, (module, package, extra, extras[extra])
