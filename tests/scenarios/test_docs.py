"""The documentation: docstring examples pass as doctests, the guide's Python snippets
run, the API reference lists every public name, and the site builds with warnings
as errors."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pathlib
import pkgutil
import re
import subprocess
import sys
import tempfile

import pytest

import optax_dls

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Pages whose ```python blocks form one runnable program each (run in order, one namespace).
RUNNABLE_PAGES = ["index.md", "troubleshooting.md"] + sorted(
  str(p.relative_to(DOCS)) for p in (DOCS / "guide").glob("*.md")
)
OPTIONAL = {"flax", "orbax"}  # a page that imports one of these is skipped without it


def _public_modules() -> list[str]:
  names = ["optax_dls"] + [m.name for m in pkgutil.walk_packages(optax_dls.__path__, "optax_dls.")]
  if importlib.util.find_spec("flax") is None:
    names.remove("optax_dls.flax")
  return sorted(names)


def test_docstring_examples_pass():
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report: list[str] = []
  for name in _public_modules():
    module = importlib.import_module(name)
    for test in finder.find(module, name, globs={}):
      runner.run(test, out=report.append)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, "".join(report)
  assert results.attempted >= 5, f"only {results.attempted} docstring examples found"


def _directives(text: str) -> set[str]:
  return set(re.findall(r"^::: ([\w.]+)\s*$", text, re.MULTILINE))


def test_api_reference_lists_every_public_name():
  documented = _directives((DOCS / "api.md").read_text())
  missing = [n for n in optax_dls.__all__ if f"optax_dls.{n}" not in documented]
  assert not missing, f"add '::: optax_dls.NAME' to docs/api.md for: {missing}"
  assert "optax_dls.flax" in documented
  submodules = {
    "compat",
    "config",
    "group_scale",
    "checkpoint",
    "writers",
    "flax",
    "cli",
  }  # public submodules
  unknown = [d for d in documented if d.split(".")[1] not in set(optax_dls.__all__) | submodules]
  assert not unknown, f"docs/api.md documents names that are not public: {unknown}"


def _python_blocks(page: str) -> list[str]:
  return re.findall(
    r"^```python\n(.*?)^```\s*$", (DOCS / page).read_text(), re.DOTALL | re.MULTILINE
  )


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_page_snippets_run(page, tmp_path, monkeypatch):
  blocks = _python_blocks(page)
  assert blocks, f"docs/{page} has no ```python block"
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # files the snippets write go here
  namespace = {"__name__": f"docs_{page}"}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"docs/{page} (python block {i})", "exec"), namespace)
    except ModuleNotFoundError as e:
      if (e.name or "").split(".")[0] in OPTIONAL:
        pytest.skip(f"docs/{page} needs {e.name}, which is not installed")
      raise


def test_site_builds_strict(tmp_path):
  for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
    if importlib.util.find_spec(module.split(".")[0]) is None:
      pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
  site = tmp_path / "site"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "mkdocs",
      "build",
      "--strict",
      "-f",
      str(ROOT / "mkdocs.yml"),
      "-d",
      str(site),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  api = (site / "api" / "index.html").read_text()
  missing = [n for n in optax_dls.__all__ if n != "writers" and f'id="optax_dls.{n}"' not in api]
  assert not missing, f"API reference has no entry for {missing}"
  assert 'id="optax_dls.flax.value_and_grad"' in api
  assert "Micikevicius" in api  # text from the docstrings, not only the headings
  assert ":func:" not in api and ":class:" not in api  # Sphinx roles rendered as code
  assert "<strong>-126" not in api  # 2**-126 is code, not bold
  assert (site / "guide" / "quickstart" / "index.html").is_file()
