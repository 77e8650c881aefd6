"""optax_dls: dynamic loss scaling for fp16 mixed-precision training, as an optax transformation.

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.

Public submodules: :mod:`optax_dls.config` (presets), :mod:`optax_dls.checkpoint` (Orbax
restore), :mod:`optax_dls.writers` (logging), :mod:`optax_dls.group_scale` (per-group
scaling), and, imported on first use, :mod:`optax_dls.cli` (the ``optax-dls`` command) and
:mod:`optax_dls.flax` (needs flax)."""

from optax_dls._util import versions as _versions

_versions.check()  # before the rest: a clear ImportError when jax, jaxlib or optax is too old

from optax_dls import checkpoint as checkpoint  # public submodules
from optax_dls import config as config
from optax_dls import group_scale as group_scale
from optax_dls import writers as writers
from optax_dls._access.find import find_state
from optax_dls._access.loss import scale_loss
from optax_dls._access.metrics import metrics
from optax_dls._access.names import nonfinite_leaves
from optax_dls._access.reset import reset_scale
from optax_dls._core.numerics import all_finite
from optax_dls._core.scalers import dynamic_loss_scale, no_loss_scale, static_loss_scale
from optax_dls._core.state import LossScaleState
from optax_dls._core.transform import loss_scaled
from optax_dls._features.alerts import SkipAlerts
from optax_dls._features.casting import cast_policy, full_precision
from optax_dls._features.locate import locate
from optax_dls._features.recompute import value_and_grad
from optax_dls._features.recompute_stats import recompute_stats
from optax_dls._features.underflow import underflow_stats
from optax_dls._policies import LossScalePolicy, amax_policy, dynamic_policy, fp32_fallback

__version__ = "0.1.0"

__all__ = [
  "LossScalePolicy",
  "LossScaleState",
  "SkipAlerts",
  "all_finite",
  "amax_policy",
  "cast_policy",
  "dynamic_loss_scale",
  "dynamic_policy",
  "find_state",
  "fp32_fallback",
  "full_precision",
  "locate",
  "loss_scaled",
  "metrics",
  "no_loss_scale",
  "nonfinite_leaves",
  "recompute_stats",
  "reset_scale",
  "scale_loss",
  "static_loss_scale",
  "underflow_stats",
  "value_and_grad",
]

# Imported on first use: importing optax_dls needs neither flax nor the command line's imports.
_ON_USE = ("cli", "flax")


def __getattr__(name: str) -> object:
  if name in _ON_USE:
    import importlib

    return importlib.import_module(f"optax_dls.{name}")
  raise AttributeError(f"module 'optax_dls' has no attribute {name!r}")
