"""The package's layout: a folder per concern, each saying what it holds, and no private
name imported from another concern."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "optax_dls"

# What each concern may import from the package (besides itself). The public modules
# (directly under optax_dls/) may import any folder.
MAY_IMPORT = {
  "_util": set(),
  "_policies": {"_util"},
  "_core": {"_util", "_policies"},
  "_access": {"_util", "_core"},
  "_integrations": {"_util", "_core", "_access"},
  "_features": {"_util", "_core", "_access", "_policies"},
  "_logs": {"_util"},
}
JAX_FREE = {"_logs"}  # the log readers import no JAX themselves
# The helpers a JAX-free concern may use: themselves JAX-free.
JAX_FREE_HELPERS = {"optax_dls._util.optional", "optax_dls._util.locate_report"}


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    yield name, path


def _concern(module):
  """The folder a module lives in (``_core``, ...), or ``public`` for optax_dls's own."""
  parts = module.split(".")
  return parts[1] if len(parts) > 2 or (len(parts) == 2 and _is_package(module)) else "public"


def _is_package(module):
  return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def _is_module(module):
  path = PACKAGE.parent / module.replace(".", "/")
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _base(node, package):
  """The absolute module an ``ImportFrom`` node imports from."""
  base = node.module or ""
  if node.level:
    up = package.split(".")[: len(package.split(".")) - node.level + 1]
    base = ".".join(up + ([node.module] if node.module else []))
  return base


def _imports(path, module):
  """``(imported module, name or None, line)`` for every import of the package, and every
  attribute read through a module imported by name (``_numerics._own_zero``)."""
  tree = ast.parse(path.read_text())
  package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((a.name, None, node.lineno) for a in node.names if a.name.startswith("optax_dls"))
    if not isinstance(node, ast.ImportFrom) or not _base(node, package).startswith("optax_dls"):
      continue
    base = _base(node, package)
    for alias in node.names:
      full = f"{base}.{alias.name}"
      if _is_module(full):
        aliases[alias.asname or alias.name] = full
      yield (full, None, node.lineno) if _is_module(full) else (base, alias.name, node.lineno)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in aliases:
      yield aliases[node.value.id], node.attr, node.lineno


def test_at_most_16_entries_under_the_package():
  entries = [p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"]
  assert len(entries) <= 16, sorted(entries)


def test_every_folder_says_what_it_holds_and_what_it_may_import():
  folders = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
  assert {f.name for f in folders} == set(MAY_IMPORT)
  for folder in folders:
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    assert doc and len(doc.split()) > 15, f"{folder.name}/__init__.py has no docstring"
    assert "import" in doc, f"{folder.name}/__init__.py does not say what it may import"


def test_no_private_name_is_imported_from_another_concern():
  bad = []
  for module, path in _modules():
    for target, name, line in _imports(path, module):
      private = name and name.startswith("_") and not name.startswith("__")
      if private and _concern(target) != _concern(module):
        bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} uses {target}.{name}")
  assert not bad, "\n".join(bad)


def test_each_concern_imports_only_what_its_folder_allows():
  bad = []
  for module, path in _modules():
    mine = _concern(module)
    if mine == "public":
      continue
    for target, _, line in _imports(path, module):
      theirs = _concern(target)
      if theirs not in {mine, *MAY_IMPORT[mine]}:
        bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} ({theirs})")
      elif mine in JAX_FREE and theirs != mine and target not in JAX_FREE_HELPERS:
        bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}, not JAX-free")
  assert not bad, "\n".join(bad)


def test_the_log_readers_import_no_jax():
  bad = []
  for module, path in _modules():
    if _concern(module) not in JAX_FREE and module not in JAX_FREE_HELPERS:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or ""]
      bad += [f"{module} imports {n}" for n in names if n.split(".")[0] in {"jax", "optax", "flax"}]
  assert not bad, bad


def test_the_design_page_draws_these_folders_and_their_imports():
  """docs/design.md's folder table names every folder and exactly what it may import."""
  import re

  text = (PACKAGE.parent / "docs" / "design.md").read_text()
  rows = re.findall(r"^\| `(_\w+)/` \| [^|]+ \| ([^|]+) \|$", text, re.MULTILINE)
  drawn = {folder: set(re.findall(r"`(_\w+)`", allowed)) for folder, allowed in rows}
  assert drawn == MAY_IMPORT
