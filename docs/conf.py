"""Sphinx configuration: the user guide in Markdown (MyST), the API reference from the
docstrings (autodoc, Google style through napoleon), sphinx-book-theme.

Build (warnings are errors, every cross-reference must resolve)::

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

from __future__ import annotations

import pathlib
import sys

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
# at build time, so they render as code without a link. References to optax_dls's public
# names are never ignored.
nitpicky = True
nitpick_ignore_regex = [
  (
    r"py:.*",
    r"(jax|jaxlib|jnp|optax|flax|nnx|numpy|np|orbax|tensorboardX|yaml|torch)(\..+)?",
  ),
  (r"py:.*", r"(collections\.abc|os|pathlib|typing)\..+"),  # the standard library's
]
# The private classes that public annotations name (the state's non-finite record, the
# scaler behind a transformation) have no entry: the docstrings that return or hold them
# describe their fields. Only these exact names are let through.
nitpick_ignore = [
  # Names the docstrings of _core and _policies/base.py still give to what is no
  # longer exported: the loss scale is find_state(opt_state).loss_scale, GradStats is
  # documented as optax_dls._policies.base.GradStats.
  ("py:func", "loss_scale"),
  ("py:class", "GradStats"),
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
  "navbar_persistent": [],  # the sidebar has the search field; no second in a top bar
}
html_show_sourcelink = False
html_static_path = ["_static"]
html_css_files = ["custom.css"]  # room for 88-character code lines at a 1200px window
