"""The documentation: docstring examples pass as doctests, the guide's Python snippets
run, and the Sphinx site builds with warnings as errors (every cross-reference
resolved), documents every public name with its real signature, renders the docstring
examples as highlighted code, and links only to its own files, relatively, so that it
can be read from disk."""

from __future__ import annotations

import doctest
import html.parser
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import subprocess
import sys
import tempfile
import urllib.parse

import jax
import pytest

import optax_dls

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Pages whose ```python blocks form one runnable program each (run in order, one namespace).
RUNNABLE_PAGES = [
  "index.md",
  "troubleshooting.md",
  "design.md",
  "example.md",
  "policies.md",
  "observability.md",
] + sorted(str(p.relative_to(DOCS)) for p in (DOCS / "guide").glob("*.md"))
# A page that imports one of these is skipped without it.
OPTIONAL = {"flax", "orbax", "jmp", "torch"}
DOCS_BUILD = ("sphinx", "myst_parser", "sphinx_book_theme")


def _public_modules() -> list[str]:
  """optax_dls and every public submodule: those whose name has no leading underscore."""
  names = ["optax_dls"] + [
    m.name
    for m in pkgutil.walk_packages(optax_dls.__path__, "optax_dls.")
    if not any(part.startswith("_") for part in m.name.split("."))
  ]
  if importlib.util.find_spec("flax") is None:
    names.remove("optax_dls.flax")
  return sorted(names)


def _public_names(module_name: str) -> list[str]:
  """A module's public names: its ``__all__``, or else every name without a leading
  underscore that the module itself defines."""
  module = importlib.import_module(module_name)
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [
    name
    for name, obj in vars(module).items()
    if not name.startswith("_") and getattr(obj, "__module__", None) == module_name
  ]


def test_docstring_examples_pass():
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  report: list[str] = []
  for name in _all_modules():
    module = importlib.import_module(name)
    for test in finder.find(module, name, globs={}):
      runner.run(test, out=report.append)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, "".join(report)
  assert results.attempted >= 5, f"only {results.attempted} docstring examples found"


def _all_modules() -> list[str]:
  """optax_dls and all its submodules, the private ones included (their docstrings too)."""
  names = ["optax_dls"] + [m.name for m in pkgutil.walk_packages(optax_dls.__path__, "optax_dls.")]
  if importlib.util.find_spec("flax") is None:
    names.remove("optax_dls.flax")
  return sorted(names)


def _python_blocks(page: str) -> list[str]:
  text = (DOCS / page).read_text()
  return re.findall(r"^```python\n(.*?)^```\s*$", text, re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_page_snippets_run(page, tmp_path, monkeypatch):
  blocks = _python_blocks(page)
  assert blocks, f"docs/{page} has no ```python block"
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # files the snippets write go here
  namespace = {"__name__": f"docs_{page}"}
  for i, block in enumerate(blocks):
    try:
      # As a script of its own: without this module's __future__ import (string annotations).
      code = compile(block, f"docs/{page} (python block {i})", "exec", dont_inherit=True)
      with jax.numpy_rank_promotion("allow"):  # the snippets' models broadcast a bias
        exec(code, namespace)  # noqa: S102
    except ModuleNotFoundError as e:
      if (e.name or "").split(".")[0] in OPTIONAL:
        pytest.skip(f"docs/{page} needs {e.name}, which is not installed")
      raise


# The longest code line a page may show: wider lines scroll sideways in the rendered site.
CODE_LINE_LIMIT = 88
CODE_PAGES = [
  ROOT / "README.md",
  *sorted(DOCS.glob("*.md")),
  *sorted((DOCS / "guide").glob("*.md")),
]


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
  """The (line number, text) of every line inside a fenced code block of a Markdown page."""
  lines, fence = [], None
  for number, line in enumerate(path.read_text().splitlines(), 1):
    opening = re.match(r"\s*(`{3,}|~{3,})", line)
    if fence is None:
      if opening:
        fence = opening.group(1)
    elif line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:  # its close
      fence = None
    else:
      lines.append((number, line))
  assert fence is None, f"{path}: a code block is never closed"
  return lines


def test_code_lines_fit_88_characters():
  """Every line of a code block in README.md, docs/*.md and docs/guide/*.md fits in 88
  characters, so that no code block of the site or the README scrolls sideways."""
  long = [
    f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
    for path in CODE_PAGES
    for number, line in _code_lines(path)
    if len(line) > CODE_LINE_LIMIT and not _set_up_command(path, line)
  ]
  assert not long, "code lines over 88 characters:\n" + "\n".join(long)


def _set_up_command(path: pathlib.Path, line: str) -> bool:
  """The README's two set-up commands, each one line to copy (and the one CI runs)."""
  return path.name == "README.md" and line.startswith("pip install") and " && " in line


def test_the_readme_test_command_installs_pytorch_s_cpu_build_first():
  """The README's test command, found as CI finds it (the first line of a code block that
  is a ``pip install ... pytest`` command), installs PyTorch's CPU build before the extras
  (without it pip fetches the CUDA build, several GB)."""
  blocks = re.findall(
    r"^```[^\n]*\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL
  )
  lines = [ln for block in blocks for ln in block.splitlines()]
  command = next(ln for ln in lines if re.match(r"^pip install .*pytest", ln))
  cpu = command.index("download.pytorch.org/whl/cpu")
  assert cpu < command.index('pip install -e ".[test') < command.index("pytest")


def test_docstring_examples_fit_88_characters():
  """The API page renders the docstrings' examples: each ``>>>`` and ``...`` line of a
  docstring in the package fits in 88 characters too."""
  long = [
    f"{path.relative_to(ROOT)}:{number}: {len(line.strip())} characters"
    for path in sorted((ROOT / "optax_dls").rglob("*.py"))
    for number, line in enumerate(path.read_text().splitlines(), 1)
    if line.strip().startswith((">>>", "...")) and len(line.strip()) > CODE_LINE_LIMIT
  ]
  assert not long, "docstring example lines over 88 characters:\n" + "\n".join(long)


def test_design_table_lists_every_module():
  """docs/design.md's layout table has a row for every module of optax_dls, and for no other."""
  package = ROOT / "optax_dls"
  modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
  rows = re.findall(r"^\| `([\w/]+\.py)` \|", (DOCS / "design.md").read_text(), re.MULTILINE)
  assert len(rows) == len(set(rows)), (
    f"listed twice: {sorted({r for r in rows if rows.count(r) > 1})}"
  )
  missing, stale = sorted(modules - set(rows)), sorted(set(rows) - modules)
  assert not missing and not stale, f"not in the table: {missing}; no such module: {stale}"


# The built site, once per session.


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  for module in DOCS_BUILD:
    if importlib.util.find_spec(module) is None:
      pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
  out = tmp_path_factory.mktemp("site")
  cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
  cmd += ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
  proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
  return out / "html"


class _Elements(html.parser.HTMLParser):
  """Every element of a page as (tag, attributes, text inside it, the ids around it)."""

  VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta"})

  def __init__(self) -> None:
    super().__init__(convert_charrefs=True)
    self.stack: list[list] = []
    self.elements: list[tuple[str, dict[str, str], str, list[dict[str, str]]]] = []

  def handle_starttag(self, tag, attrs):
    attributes = {k: v or "" for k, v in attrs}
    if tag in self.VOID:
      self.elements.append((tag, attributes, "", [a for _, a, _ in self.stack]))
    else:
      self.stack.append([tag, attributes, []])

  def handle_endtag(self, tag):
    while self.stack:
      name, attributes, text = self.stack.pop()
      content = "".join(text)
      self.elements.append((name, attributes, content, [a for _, a, _ in self.stack]))
      if self.stack:
        self.stack[-1][2].append(content)
      if name == tag:
        break

  def handle_data(self, data):
    if self.stack:
      self.stack[-1][2].append(data)


def _elements(page: pathlib.Path) -> list[tuple[str, dict[str, str], str, list[dict[str, str]]]]:
  parser = _Elements()
  parser.feed(page.read_text())
  parser.close()
  return parser.elements


def _entries(page: pathlib.Path) -> dict[str, str]:
  """The API entries of a page: each object's id and the HTML of its description."""
  text = page.read_text()
  starts = [
    (m.start(), m.group(1)) for m in re.finditer(r'<dt class="sig[^"]*" id="([^"]+)"', text)
  ]
  return {
    name: text[start : (starts[i + 1][0] if i + 1 < len(starts) else len(text))]
    for i, (start, name) in enumerate(starts)
  }


def test_every_page_is_built(site):
  sources = [p for p in DOCS.rglob("*") if p.suffix in {".md", ".rst"} and "_build" not in p.parts]
  missing = [
    str(p) for p in sources if not (site / p.relative_to(DOCS)).with_suffix(".html").is_file()
  ]
  assert not missing, missing
  assert "Micikevicius" in (site / "api.html").read_text()  # the docstrings, not only headings


def test_api_reference_documents_every_public_name(site):
  ids = set(re.findall(r'\bid="([^"]+)"', (site / "api.html").read_text()))
  expected = [f"optax_dls.{name}" for name in optax_dls.__all__]
  for module in _public_modules():
    if module != "optax_dls":
      expected.append(f"module-{module}")
      expected += [f"{module}.{name}" for name in _public_names(module)]
  missing = [name for name in expected if name not in ids]
  assert not missing, f"docs/api.rst documents none of {missing}"


def test_docstring_example_renders_as_highlighted_code(site):
  entry = _entries(site / "api.html")["optax_dls.dynamic_loss_scale"]
  page = site / "entry.html"
  page.write_text(entry)
  blocks = [
    (text, around)
    for tag, attributes, text, around in _elements(page)
    if tag == "pre" and ">>> tx = optax_dls.dynamic_loss_scale(" in text
  ]
  page.unlink()
  assert len(blocks) == 1, entry
  text, around = blocks[0]
  classes = [a.get("class", "") for a in around]
  assert any("highlight" in c.split() for c in classes), classes  # Pygments' <div>
  assert any(c.startswith(("doctest", "highlight-")) for c in classes), classes
  assert "Array([-0.2, -0.2, -0.2], dtype=float32)" in text  # the output, in the same block
  assert '<span class="gp">&gt;&gt;&gt; </span>' in entry  # the prompts, highlighted
  assert "<blockquote>" not in entry


def _rendered_parameters(entry: str) -> list[str]:
  signature = entry[: entry.index("</dt>")]
  params = re.findall(r'<em class="sig-param">(.*?)</em>', signature, re.DOTALL)
  names = []
  for param in params:
    text = re.sub(r"<[^>]+>", "", param)
    name = re.match(r"\s*(\*{0,2}\w+)", text)
    if name:
      names.append(name.group(1))
  return names


def _public_functions() -> list[str]:
  """The dotted name of every public function: in ``optax_dls.__all__`` and in each public
  submodule."""
  names = []
  for module in _public_modules():
    for name in _public_names(module):
      if inspect.isfunction(getattr(importlib.import_module(module), name)):
        names.append(f"{module}.{name}")
  return names


@pytest.mark.parametrize("name", _public_functions())
def test_api_reference_shows_the_real_signature(site, name):
  entry = _entries(site / "api.html")[name]
  module, attribute = name.rsplit(".", 1)
  expected = []
  for p in inspect.signature(
    getattr(importlib.import_module(module), attribute)
  ).parameters.values():
    prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
    expected.append(prefix + p.name)
  assert _rendered_parameters(entry) == expected


def test_links_are_relative_and_resolve(site):
  """The site works opened from disk (file://): every link to its own pages and files is
  relative and names a file that exists."""
  bad = []
  pages = [p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts]
  assert len(pages) > 20
  for page in pages:
    for tag, attributes, _, _ in _elements(page):
      for key in ("href", "src"):
        url = attributes.get(key)
        if tag not in {"a", "link", "script", "img"} or not url:
          continue
        parts = urllib.parse.urlsplit(url)
        if parts.scheme or url.startswith("#"):  # another site, mailto:, or this page
          continue
        if url.startswith("/"):
          bad.append(f"{page.relative_to(site)}: {url} (absolute)")
        elif not (page.parent / urllib.parse.unquote(parts.path)).exists():
          bad.append(f"{page.relative_to(site)}: {url} (missing)")
  assert not bad, "\n".join(sorted(set(bad)))
