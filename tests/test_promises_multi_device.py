"""docs/multi_device.md: each single-process snippet runs as is on a CPU (8 virtual devices,
a fresh process each: they set the device count before JAX starts) and prints what its
comments say; with ``axis_name="data"`` the ``shard_map`` snippet raises at trace time."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "multi_device.md"


def _snippet(title):
  """The ```python block under the ``### <title>`` heading."""
  text = PAGE.read_text()
  section = text.split(f"### {title}", 1)[1]
  return re.search(r"^```python\n(.*?)^```\s*$", section, re.DOTALL | re.MULTILINE).group(1)


def _run(code):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False
  )


def _printed_comments(code):
  """What the snippet's comments say each ``print`` shows: the text after ``# `` up to a
  ``:`` that explains it."""
  said = re.findall(r"^print\(.*\)  # (.*)$", code, re.MULTILINE)
  return [s.split(":")[0] if not s.startswith("P(") else s.split(": ")[0] for s in said]


@pytest.mark.parametrize(
  "title",
  [
    "`jit` with `NamedSharding` (no `axis_name`)",
    "`shard_map` (`axis_name` = every axis the gradients vary over)",
    "`pmap` (`axis_name` = the pmap axis)",
    "`vmap` (an ensemble: one scale per member, or one shared)",
  ],
  ids=["jit", "shard_map", "pmap", "vmap"],
)
def test_each_snippet_runs_as_is_and_prints_what_its_comments_say(title):
  code = _snippet(title)
  proc = _run(code)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  said = _printed_comments(code)
  assert len(lines) == len(said) >= 1, (lines, said)
  for line, expected in zip(lines, said):
    assert line.split() == expected.split(), (line, expected)


def test_the_shard_map_snippet_with_axis_name_data_raises_at_trace_time():
  code = _snippet("`shard_map` (`axis_name` = every axis the gradients vary over)")
  code = code.replace('axis_name=("data", "model")', 'axis_name="data"')
  proc = _run(code)
  assert proc.returncode != 0
  assert "ValueError: axis_name='data' does not cover the mapped axes ['model']" in proc.stderr
