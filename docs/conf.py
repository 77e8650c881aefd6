"""Sphinx configuration: the user guide in Markdown (MyST), the API reference from the
docstrings (autodoc, Google style through napoleon), sphinx-book-theme.

Build (warnings are errors, every cross-reference must resolve)::

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

from __future__ import annotations

import logging
import pathlib
import re
import sys

from docutils import nodes
from docutils.utils import get_source_line
from sphinx.application import Sphinx
from sphinx.util import logging as sphinx_logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout, whatever else is installed

import optax_dls

project = "optax_dls"
author = "the optax_dls authors"
copyright = "the optax_dls authors, Apache License 2.0"  # the footer's line
release = version = optax_dls.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Every reference must resolve (nitpicky; the build runs with -W). The references into
# other projects cannot: there is no network to fetch their intersphinx inventories from
# at build time, so they render as code without a link. References to optax_dls's own
# names are never ignored.
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(jax|jaxlib|jnp|optax|flax|nnx|numpy|np|orbax|tensorboardX|yaml|torch)(\..+)?"),
  (r"py:.*", r"(collections\.abc|os|pathlib|typing)\..+"),  # the standard library's
]

# MyST: the guide pages are plain Markdown; "#anchor" links to headings of other pages.
myst_heading_anchors = 4

# autodoc + napoleon: Google-style sections (Args, Returns, Raises, Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # 2**15 as written, not 32768.0
autodoc_default_options = {"exclude-members": "__init__, __new__"}

html_theme = "sphinx_book_theme"
html_title = f"optax_dls {release}"
html_theme_options = {
  "repository_url": "https://github.com/optax-dls/optax_dls",
  "use_repository_button": True,
  "path_to_docs": "docs",
  "show_toc_level": 2,
  "navbar_persistent": [],  # the sidebar has the search field; no second one in a top bar
}
html_show_sourcelink = False

# Warnings from docstrings that are yet to be fixed in optax_dls/ (each: the object, and
# a pattern of the warning). They are reported at the end of the build but do not fail
# it. Remove an entry as soon as its docstring is fixed; an entry that matches nothing
# is reported too, so that none outlives its fix.
_DOC = r"docstring of optax_dls\.(?:\S*\.)?"  # the object, in whichever module defines it
PENDING_DOCSTRING_FIXES: list[tuple[str, str]] = [
  # __signature__ rewritten by hand; explicit keyword arguments will replace it.
  ("dynamic_loss_scale", r"error while formatting arguments for optax_dls\.dynamic_loss_scale"),
  # "Keys:" is no napoleon section: an indented block after a paragraph.
  ("metrics", _DOC + r"metrics:.*(Unexpected indentation|Block quote ends|Definition list ends)"),
  # "TypeError / ValueError:" in Raises is read as one exception's name.
  ("SkipAlerts", _DOC + r"SkipAlerts:.*TypeError / ValueError"),
  ("skips_at_min_scale", _DOC + r"skips_at_min_scale:.*TypeError / ValueError"),
  ("compat presets", r"reference target not found: ValueError / TypeError"),
  # :class: references to the private state classes, which have no API entry.
  ("skips_at_min_scale state", _DOC + r"skips_at_min_scale:.*SkipsAtMinScaleState"),
  ("fp32_fallback", _DOC + r"fp32_fallback:.*FallbackState"),
  ("amax_policy", _DOC + r"amax_policy:.*AmaxScaleState"),
  ("dynamic_policy", _DOC + r"dynamic_policy:.*DynamicScaleState"),
  ("static_policy", _DOC + r"static_policy:.*DynamicScaleState"),
  ("underflow_stats", _DOC + r"underflow_stats:.*UnderflowState"),
  # Names of optax_dls written unqualified in a submodule, where they do not resolve.
  (
    "compat",
    r"docstring of optax_dls\.compat(\.torch_policy)?:.*target not found: LossScalePolicy",
  ),
  ("compat module docstring", r"docstring of optax_dls\.compat:.*Definition list ends"),
  (
    "config",
    (
      r"docstring of optax_dls\.config(\.\w+)?:.*reference target not found: (LossScalePolicy|"
      r"SkipAlerts|dynamic_policy|dynamic_loss_scale|fp32_fallback|loss_scaled|underflow_stats)"
    ),
  ),
]


class _PendingDocstringFixes(logging.Filter):
  def __init__(self) -> None:
    super().__init__()
    self.patterns = [(obj, re.compile(pattern)) for obj, pattern in PENDING_DOCSTRING_FIXES]
    self.matched: dict[str, int] = {}

  def filter(self, record: logging.LogRecord) -> bool:
    try:
      message = str(record.msg) % record.args if record.args else str(record.msg)
    except (TypeError, ValueError):
      message = str(record.msg)
    location = getattr(record, "location", None)
    if isinstance(location, nodes.Node):  # where Sphinx prints it: the node's source and line
      source, line = get_source_line(location)
      location = f"{source or ''}:{line or ''}"
    text = f"{location or ''}: {message}"
    for obj, pattern in self.patterns:
      if pattern.search(text):
        self.matched[obj] = self.matched.get(obj, 0) + 1
        return False
    return True


def _report_pending(
  app: Sphinx, exception: Exception | None, pending: _PendingDocstringFixes
) -> None:
  if not PENDING_DOCSTRING_FIXES or exception is not None:
    return
  count = sum(pending.matched.values())
  stale = sorted({obj for obj, _ in PENDING_DOCSTRING_FIXES} - set(pending.matched))
  sphinx_logging.getLogger(__name__).info(
    f"{count} warnings from docstrings awaiting a fix (docs/conf.py PENDING_DOCSTRING_FIXES)"
    + (f"; entries that matched nothing, to remove: {stale}" if stale else "")
  )


def setup(app: Sphinx) -> dict[str, bool]:
  pending = _PendingDocstringFixes()
  for handler in logging.getLogger(sphinx_logging.NAMESPACE).handlers:
    if isinstance(handler, sphinx_logging.WarningStreamHandler):
      handler.filters.insert(0, pending)  # before -W turns the warning into an error
  app.connect("build-finished", lambda app, exc: _report_pending(app, exc, pending))
  return {"parallel_read_safe": True}
