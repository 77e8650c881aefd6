"""The optional dependencies (module: pip package, extra) and the error naming the extra."""

from __future__ import annotations

import importlib
import types

PACKAGES = {  # monitoring: writing TensorBoard events, reading them, inspect --plot, YAML
  "tensorboardX": ("tensorboardX", "monitoring"),
  "tensorboard": ("tensorboard", "monitoring"),
  "matplotlib": ("matplotlib", "monitoring"),
  "yaml": ("PyYAML", "monitoring"),
  "flax": ("flax", "flax"),
  "orbax": ("orbax-checkpoint", "checkpoint"),
}


class MissingExtraError(ImportError):
  """An optional dependency is not installed; the message names the extra that installs it."""


def install(extra: str) -> str:
  """The command that installs ``extra`` from optax_dls's folder: ``pip install -e ".[flax]"``."""
  return f'pip install -e ".[{extra}]"'


def require(module: str, feature: str, otherwise: str = "") -> types.ModuleType:
  """Imports ``module`` for ``feature``; else MissingExtraError naming the extra, ``otherwise``."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    package, extra = PACKAGES[module.split(".")[0]]
    alternative = f", or {otherwise}" if otherwise else ""
    raise MissingExtraError(
      f"{feature} needs {package} ({e}): pip install {package} (or, in optax_dls's folder, "
      f"the {extra!r} extra: {install(extra)}){alternative}"
    ) from e
