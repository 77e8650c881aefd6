"""Griffe extension for the API reference: makes the docstrings' reStructuredText
habits render as Markdown.

* ``:func:`name``` (any Sphinx role) becomes a code span, linked to the API
  entry when ``name`` is public in ``optax_dls``;
* powers written bare, such as 2**-126, become code spans, so that Markdown
  does not read ``**`` as bold.

Doctest lines (``>>>`` / ``...``) are left alone.
"""

from __future__ import annotations

import re

import griffe

import optax_dls

_PUBLIC = set(optax_dls.__all__)
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`~?(?:optax_dls\.)?([\w.]+)`")
_CODE = re.compile(r"(``.*?``|`[^`\n]*`)")
_POWER = re.compile(r"(?<![\w.*])\d+\*\*-?\d+(?:\s*-\s*\d+)?")


def _role(m: re.Match) -> str:
  name = m.group(1)
  return f"[`{name}`][optax_dls.{name}]" if name.split(".")[0] in _PUBLIC else f"`{name}`"


def _line(line: str) -> str:
  if line.lstrip().startswith((">>>", "...")):
    return line
  line = _ROLE.sub(_role, line)
  parts = _CODE.split(line)
  parts[::2] = [_POWER.sub(lambda m: f"`{m.group(0)}`", p) for p in parts[::2]]
  return "".join(parts)


def markdownify(text: str) -> str:
  """The docstring ``text`` with roles and bare powers turned into code spans."""
  return "\n".join(_line(line) for line in text.split("\n"))


class RstToMarkdown(griffe.Extension):
  """Applies :func:`markdownify` to every docstring as it is loaded."""

  def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
    if obj.docstring is not None:
      obj.docstring.value = markdownify(obj.docstring.value)
