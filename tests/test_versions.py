"""The supported versions: one set of floors in pyproject.toml and in the import check."""

import os
import re
import subprocess
import sys
import tomllib

import jax
import jaxlib
import pytest

from optax_dls._util import versions as _versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def _floors(requirements):
  """{name: floor} for each ``name>=floor`` requirement."""
  found = {}
  for req in requirements:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", req.strip())
    if m:
      found[m[1]] = m[3]
  return found


def test_the_floors_are_the_ones_pyproject_declares():
  project = _project()
  assert project["requires-python"] == f">={_versions.PYTHON_MIN}"
  deps = project["dependencies"]
  assert _floors(deps) == _versions.REQUIRED
  assert len(deps) == len(_versions.REQUIRED)  # every dependency has a floor, which CI tests
  extras = project["optional-dependencies"]
  for extra in ("flax", "examples", "test"):
    assert _floors(extras[extra]).get("flax") == _versions.FLAX_MIN, extra


def test_the_installed_versions_pass():
  _versions.check()


def test_too_old_jax_is_named_with_the_required_version(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.6.2")
  monkeypatch.setattr(jaxlib, "__version__", "0.6.2")
  with pytest.raises(ImportError) as e:
    _versions.check()
  msg = str(e.value)
  assert f"jax>={_versions.JAX_MIN}, but jax 0.6.2 is installed" in msg
  assert f"jaxlib>={_versions.JAXLIB_MIN}, but jaxlib 0.6.2 is installed" in msg
  assert f"pip install -U 'jax>={_versions.JAX_MIN}' 'jaxlib>={_versions.JAXLIB_MIN}'" in msg
  assert "optax>=" not in msg


def test_too_old_python_and_optax_are_named():
  installed = {
    "python": "3.10.13",
    "jax": _versions.JAX_MIN,
    "jaxlib": _versions.JAXLIB_MIN,
    "optax": "0.2.4",
  }
  with pytest.raises(
    ImportError,
    match=re.escape(
      f"python>={_versions.PYTHON_MIN}, but python 3.10.13 is installed; "
      f"optax>={_versions.OPTAX_MIN}, but optax 0.2.4 is installed: "
      f"pip install -U 'optax>={_versions.OPTAX_MIN}'"
    ),
  ):
    _versions.check(installed)


def test_the_floors_themselves_and_release_candidates_of_them_pass():
  _versions.check(
    {
      "python": _versions.PYTHON_MIN,
      "jax": _versions.JAX_MIN + "rc1",
      "jaxlib": _versions.JAXLIB_MIN + ".dev20250101",
      "optax": _versions.OPTAX_MIN,
    }
  )


def test_too_old_flax_is_named():
  _versions.check_flax(_versions.FLAX_MIN)
  with pytest.raises(
    ImportError,
    match=re.escape(
      f"optax_dls.flax needs flax>={_versions.FLAX_MIN}, but flax 0.10.7 is installed"
    ),
  ):
    _versions.check_flax("0.10.7")


def test_versions_compare_by_release_numbers():
  p = _versions.parse
  assert p("0.7.0") == p("0.7") == p("0.7.0rc1") == p("0.7.0.dev20250101") == (0, 7)
  assert p("0.10.2") > p("0.9.0") and p("1.0") > p("0.99.9") and p("0.7.1") > p("0.7.0.post1")


def test_import_on_a_too_old_jax_fails_with_the_message():
  code = "import jax; jax.__version__ = '0.6.2'; import optax_dls"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
  )
  assert out.returncode != 0
  assert (
    f"ImportError: optax_dls needs jax>={_versions.JAX_MIN}, but jax 0.6.2 is installed: "
    f"pip install -U 'jax>={_versions.JAX_MIN}'"
  ) in out.stderr


def test_import_of_the_flax_helpers_on_a_too_old_flax_fails_with_the_message():
  pytest.importorskip("flax", reason="flax (the flax extra) is not installed")
  code = "import flax; flax.__version__ = '0.10.7'; import optax_dls.flax"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
  )
  assert out.returncode != 0
  assert (
    f"ImportError: optax_dls.flax needs flax>={_versions.FLAX_MIN}, but flax 0.10.7 is installed"
  ) in out.stderr
