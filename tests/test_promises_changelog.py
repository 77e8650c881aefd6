"""CHANGELOG.md's claims about the package as it is now that no other test holds:
the public names of `cli` and `writers`, and the packaging metadata."""

import pathlib
import re
import tomllib

import optax_dls
import optax_dls.cli
import optax_dls.writers

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cli_and_writers_declare_the_names_the_changelog_lists():
  assert optax_dls.cli.__all__ == ["main"]
  assert optax_dls.writers.__all__ == ["MetricsWriter"]
  for module in (optax_dls.cli, optax_dls.writers):
    assert all(callable(getattr(module, name)) for name in module.__all__)


def test_packaging_metadata_is_what_the_changelog_says():
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  project = pyproject["project"]
  # The license is an SPDX expression with its file, built by setuptools 77 or newer.
  assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
  assert "Apache License" in (ROOT / "LICENSE").read_text()
  assert "setuptools>=77" in pyproject["build-system"]["requires"]
  # The version is written once, in optax_dls/__init__.py, and read from there.
  assert "version" not in project and project["dynamic"] == ["version"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "optax_dls.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", optax_dls.__version__)
  # Typed: the classifier, and the marker shipped in the wheel.
  assert "Typing :: Typed" in project["classifiers"]
  assert (ROOT / "optax_dls" / "py.typed").is_file()
  assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["optax_dls"]
  assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(project["urls"])
