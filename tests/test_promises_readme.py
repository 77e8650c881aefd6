"""README.md's install table: what `pip install -e .` and each extra bring is what
pyproject.toml declares."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The README's names for packages whose distribution name differs.
DISTRIBUTION = {"pytorch": "torch"}


def _names(requirements):
  return {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower() for req in requirements}


def _readme_extras():
  """``{extra: [package, ...]}`` from the README's table of extras."""
  text = (ROOT / "README.md").read_text().split("## Install")[1].split("\n## ")[0]
  extras = {}
  for extra, brings in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.MULTILINE):
    items = re.split(r", (?:and )?| and ", brings.strip())
    packages = []
    for item in items:
      item = item.removeprefix("the oracles ").strip()
      if item.startswith("the "):  # "the docs' tools": the docs extra, checked there
        continue
      packages.append(DISTRIBUTION.get(item.lower(), item.lower()))
    extras[extra] = packages
  return extras


def test_readme_install_table_is_what_pyproject_declares():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  # "`pip install -e .` brings jax, jaxlib and optax only"
  assert _names(project["dependencies"]) == {"jax", "jaxlib", "optax"}
  declared = project["optional-dependencies"]
  extras = _readme_extras()
  assert set(extras) == set(declared)  # every extra has a row, and no row names another
  for extra, packages in extras.items():
    missing = set(packages) - _names(declared[extra])
    assert not missing, f"README says the {extra} extra brings {missing}; pyproject does not"
  assert set(extras["test"]) >= {"torch", "jmp", "keras", "megatron-core"}
  assert _names(declared["docs"]) <= _names(declared["test"])  # "the docs' tools"
