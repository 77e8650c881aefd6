"""XLA's CPU compiler turned down for the tests, with only the options this jaxlib knows.

The tests check values, bits, types and decisions, and spend most of their time
compiling many small programs: XLA's backend optimizations off, its classic kernel
emitters, and machine code emitted in one piece (not split for threads that small
kernels do not keep busy) take about half the time. ``tests/conftest.py`` calls
:func:`turn_down` before JAX starts. A test about the compiled program itself (its
copies, its scratch memory, or that two programs give the same bits) compiles with
:data:`XLA_DEFAULTS`, XLA's own values of the same options. With
``OPTAX_DLS_TEST_XLA=default`` nothing is turned down.

An option that a jaxlib release no longer knows would end the process when given in
``XLA_FLAGS``, so each is tried in a short subprocess first (once per test session:
the result is handed to the workers and subprocesses in the environment).
"""

from __future__ import annotations

import os
import subprocess
import sys

# option -> (the value the tests compile with, XLA's default)
OPTIONS = {
  "xla_backend_optimization_level": (0, 3),
  "xla_cpu_use_fusion_emitters": (False, True),
  "xla_cpu_parallel_codegen_split_count": (1, 32),
}
_ACCEPTED = "OPTAX_DLS_TEST_XLA_OPTIONS"  # the options found known, comma separated


def _flag(name: str, value: object) -> str:
  return f"--{name}={str(value).lower()}"


def _known(names: list[str]) -> bool:
  """Whether a process with these options in ``XLA_FLAGS`` starts JAX and computes."""
  flags = " ".join(_flag(n, OPTIONS[n][0]) for n in names)
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
  probe = "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"
  run = [sys.executable, "-c", probe]
  return subprocess.run(run, check=False, env=env, capture_output=True, timeout=120).returncode == 0


def accepted() -> list[str]:
  """The options of :data:`OPTIONS` in effect for this test session."""
  if os.environ.get("OPTAX_DLS_TEST_XLA") == "default":
    return []
  if _ACCEPTED not in os.environ:
    names = list(OPTIONS)
    if not _known(names):
      names = [n for n in names if _known([n])]
    os.environ[_ACCEPTED] = ",".join(names)
  return [n for n in os.environ[_ACCEPTED].split(",") if n]


def turn_down() -> None:
  """Puts the accepted options in ``XLA_FLAGS`` (once: workers inherit them)."""
  flags = os.environ.get("XLA_FLAGS", "")
  new = [_flag(n, OPTIONS[n][0]) for n in accepted() if f"--{n}=" not in flags]
  os.environ["XLA_FLAGS"] = " ".join([flags, *new]).strip()


# XLA's own values of the options turned down, for compiler_options=.
XLA_DEFAULTS = {n: OPTIONS[n][1] for n in accepted()}
