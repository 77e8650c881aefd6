"""The optional dependencies of the monitoring tools, and the one-line error when one is missing.

``tensorboardX`` (TensorBoard events written by
:class:`optax_dls.writers.MetricsWriter`), ``tensorboard`` (reading event
files) and ``matplotlib`` (``optax-dls inspect --plot``) come with the
``monitoring`` extra.
"""

from __future__ import annotations

import importlib
import types

INSTALL = 'pip install "optax_dls[monitoring]"'


class MissingExtraError(ImportError):
  """An optional dependency is not installed; the message names the extra that installs it."""


def require(module: str, feature: str, otherwise: str = "") -> types.ModuleType:
  """Imports ``module``, which ``feature`` needs.

  Args:
    module: the dotted module name, e.g. ``"matplotlib.pyplot"``; its first
      component is the package to install.
    feature: what needs it, for the message, e.g. ``"--plot"``.
    otherwise: what else the user can do, ending the message
      (e.g. ``"pass tensorboard=False"``). Default: nothing.

  Returns:
    The module.

  Raises:
    MissingExtraError: the module cannot be imported; one line naming the
      package, the extra to install, and the import error.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    package = module.split(".")[0]
    alternative = f", or {otherwise}" if otherwise else ""
    raise MissingExtraError(f"{feature} needs {package} ({e}): {INSTALL}{alternative}") from e
