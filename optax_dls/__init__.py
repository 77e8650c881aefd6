"""optax_dls: dynamic loss scaling for fp16 mixed-precision training, as an optax transformation.

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.

Public submodules: :mod:`optax_dls.compat` (policies that reproduce other
frameworks' scale trajectories), :mod:`optax_dls.writers` (JSONL /
TensorBoard logging), :mod:`optax_dls.checkpoint` (Orbax restore),
:mod:`optax_dls.group_scale` (per-group gradient scaling),
:mod:`optax_dls.config` (presets and configuration files),
:mod:`optax_dls.cli` (the ``optax-dls`` command), and, imported on use,
:mod:`optax_dls.flax` (Flax helpers; needs flax).
"""

import sys as _sys

from optax_dls._util import versions as _versions

_versions.check()  # before the rest: a clear ImportError when jax, jaxlib or optax is too old

from optax_dls import _policies
from optax_dls import checkpoint as checkpoint  # public submodules
from optax_dls import compat as compat
from optax_dls import config as config
from optax_dls import group_scale as group_scale
from optax_dls import writers as writers
from optax_dls._access.find import find_state
from optax_dls._access.loss import loss_scale, scale_loss
from optax_dls._access.metrics import metrics
from optax_dls._access.names import leaf_names, nonfinite_leaves
from optax_dls._access.reset import reset_scale
from optax_dls._core import lowering as _lowering
from optax_dls._core import passthrough as _passthrough
from optax_dls._core import record as _record
from optax_dls._core import scaler as _scaler
from optax_dls._core import state as _state
from optax_dls._core.apply_step import apply_step
from optax_dls._core.numerics import all_finite
from optax_dls._core.scalers import dynamic_loss_scale, no_loss_scale, static_loss_scale
from optax_dls._core.state import LossScaleState
from optax_dls._core.transform import LossScaledTransformation, loss_scaled
from optax_dls._features import alerts as _alerts
from optax_dls._features import casting as _casting
from optax_dls._features import recompute_stats as _recompute_stats
from optax_dls._features import underflow as _underflow
from optax_dls._features.alerts import SkipAlerts
from optax_dls._features.casting import CastPolicy, cast_policy, full_precision
from optax_dls._features.locate import locate
from optax_dls._features.precision import select_precision
from optax_dls._features.recompute import value_and_grad
from optax_dls._features.recompute_stats import recompute_stats
from optax_dls._features.underflow import underflow_stats
from optax_dls._integrations import flax_serialization as _flax_serialization
from optax_dls._policies import (
  GradStats,
  LossScalePolicy,
  amax_policy,
  dynamic_policy,
  fp32_fallback,
  noop_policy,
  skips_at_min_scale,
  static_policy,
)
from optax_dls._util import locate_report as _locate_report

__version__ = "0.1.0"

_state.ON_INIT.append(_flax_serialization.register)  # flax's restore into a LossScaleState

# Every public type, every type a state holds, and what a pickled transformation or locate
# report names, pickles as ``optax_dls.<name>``, so that moving a private module never breaks
# a pickle: the public ones are in ``__all__``, the others resolve through ``__getattr__``.
_BY_NAME = {
  t.__name__: t
  for t in (
    _record.NonFiniteRecord,
    _policies.DynamicScaleState,
    _policies.AmaxScaleState,
    _policies.FallbackState,
    _policies.SkipsAtMinScaleState,
    _underflow.UnderflowState,
    _recompute_stats.RecomputeState,
    _scaler.LossScaler,  # what a pickled LossScaledTransformation's methods belong to
    _passthrough.PassthroughScaler,
    _lowering.Lowering,
    _policies.DynamicRule,
    _locate_report.LocateReport,  # what locate returns
    _locate_report.Operation,
    _locate_report.ScopeHeadroom,
  )
}
_PUBLIC_TYPES = (
  CastPolicy,
  GradStats,
  LossScalePolicy,
  LossScaleState,
  LossScaledTransformation,
  SkipAlerts,
)
for _type in (*_PUBLIC_TYPES, *_BY_NAME.values()):
  _type.__module__ = __name__

# The modules that held those types before the package had folders: a pickle made then
# still loads.
for _old, _module in {
  "_state": _state,
  "_localisation": _record,
  "_underflow": _underflow,
  "_recompute_stats": _recompute_stats,
  "_casting": _casting,
  "_alerts": _alerts,
}.items():
  _sys.modules.setdefault(f"{__name__}.{_old}", _module)

__all__ = [
  "CastPolicy",
  "GradStats",
  "LossScalePolicy",
  "LossScaleState",
  "LossScaledTransformation",
  "SkipAlerts",
  "all_finite",
  "amax_policy",
  "apply_step",
  "cast_policy",
  "dynamic_loss_scale",
  "dynamic_policy",
  "find_state",
  "fp32_fallback",
  "full_precision",
  "leaf_names",
  "locate",
  "loss_scale",
  "loss_scaled",
  "metrics",
  "no_loss_scale",
  "nonfinite_leaves",
  "noop_policy",
  "recompute_stats",
  "reset_scale",
  "scale_loss",
  "select_precision",
  "skips_at_min_scale",
  "static_loss_scale",
  "static_policy",
  "underflow_stats",
  "value_and_grad",
]

# Public submodules imported on first use, so that importing optax_dls needs neither flax
# nor the command line's dependencies: ``optax_dls.flax`` works without ``import
# optax_dls.flax`` (and names the extra to install when flax is missing).
_ON_USE = ("cli", "flax")


def __getattr__(name: str) -> object:
  if name in _BY_NAME:
    return _BY_NAME[name]
  if name in _ON_USE:
    import importlib

    return importlib.import_module(f"optax_dls.{name}")
  raise AttributeError(f"module 'optax_dls' has no attribute {name!r}")
