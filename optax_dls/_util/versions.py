"""The oldest Python, JAX, jaxlib, optax and flax supported (as ``pyproject.toml``), checked."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

PYTHON_MIN = "3.11"
JAX_MIN = "0.7.1"
JAXLIB_MIN = "0.7.1"
OPTAX_MIN = "0.2.5"
FLAX_MIN = "0.11.0"  # optax_dls.flax only

REQUIRED = {"jax": JAX_MIN, "jaxlib": JAXLIB_MIN, "optax": OPTAX_MIN}


def parse(version: str) -> tuple[int, ...]:
  """The release numbers at the start of ``version``: ``"0.7.0rc1"`` -> ``(0, 7)``."""
  m = re.match(r"\d+(?:\.\d+)*", str(version).strip())
  if not m:
    return ()
  numbers = [int(n) for n in m.group().split(".")]
  while len(numbers) > 1 and numbers[-1] == 0:  # "0.7" == "0.7.0"
    numbers.pop()
  return tuple(numbers)


def too_old(installed: Mapping[str, str], required: Mapping[str, str]) -> list[str]:
  """``"name>=floor, but name X is installed"`` for each package below its floor."""
  return [
    f"{name}>={floor}, but {name} {installed[name]} is installed"
    for name, floor in required.items()
    if name in installed and parse(installed[name]) < parse(floor)
  ]


def _installed() -> dict[str, str]:
  """The versions of jax, jaxlib and optax, without importing optax."""
  import jax  # jax checks that its jaxlib is one it can run with
  import jaxlib

  found = {
    "python": "{}.{}.{}".format(*sys.version_info[:3]),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
  }
  try:
    from importlib.metadata import version

    found["optax"] = version("optax")
  except Exception:  # noqa: BLE001 (no metadata, e.g. a source checkout on sys.path): optax's own
    import optax

    found["optax"] = optax.__version__
  return found


def check(installed: Mapping[str, str] | None = None) -> None:
  """ImportError when Python, jax, jaxlib or optax is older than the floor."""
  installed = _installed() if installed is None else installed
  problems = too_old(installed, {"python": PYTHON_MIN, **REQUIRED})
  if problems:
    upgrade = " ".join(
      f"'{n}>={REQUIRED[n]}'" for n in REQUIRED if parse(installed.get(n, "0")) < parse(REQUIRED[n])
    )
    hint = f": pip install -U {upgrade}" if upgrade else ""
    raise ImportError(f"optax_dls needs {'; '.join(problems)}{hint}")


def check_flax(version: str | None = None) -> None:
  """Raises ImportError when flax is older than :data:`FLAX_MIN` (for ``optax_dls.flax``)."""
  if version is None:
    import flax

    version = flax.__version__
  if parse(version) < parse(FLAX_MIN):
    raise ImportError(
      f"optax_dls.flax needs flax>={FLAX_MIN}, but flax {version} is installed: "
      f"pip install -U 'flax>={FLAX_MIN}'"
    )
