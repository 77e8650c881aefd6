"""Every test that tests/PROMISES.md names exists, so the list cannot rot."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMISES = ROOT / "tests" / "PROMISES.md"
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _tests_in(path):
  """The names of the test functions and test classes (and module-level test
  aliases) defined in ``path``."""
  tree = ast.parse(path.read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return {n for n in names if n.startswith(("test_", "Test"))}


def _rows():
  rows = []
  for line in PROMISES.read_text().splitlines():
    if line.startswith("|") and not line.startswith(("|---", "| promise")):
      rows.append(line)
  return rows


def test_every_row_names_a_test():
  bad = [row for row in _rows() if not NAMED.search(row)]
  assert not bad, f"rows of PROMISES.md without a test: {bad}"


def test_every_named_test_exists():
  missing = []
  cache = {}
  for row in _rows():
    for file, name in NAMED.findall(row):
      path = ROOT / file
      if path not in cache:
        cache[path] = _tests_in(path) if path.is_file() else set()
      if name not in cache[path]:
        missing.append(f"{file}::{name}")
  assert not missing, f"PROMISES.md names tests that do not exist: {missing}"
  assert len(cache) > 10
