"""optax_dls: dynamic loss scaling for fp16 mixed-precision training, as an optax transformation.

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.

Public submodules: :mod:`optax_dls.config` (presets, among them other
frameworks' scale trajectories, and configuration files),
:mod:`optax_dls.writers` (JSONL / TensorBoard logging),
:mod:`optax_dls.checkpoint` (Orbax restore),
:mod:`optax_dls.group_scale` (per-group gradient scaling), and, imported on
first use, :mod:`optax_dls.cli` (the ``optax-dls`` command) and
:mod:`optax_dls.flax` (Flax helpers; needs flax).
"""

import copyreg as _copyreg
import sys as _sys
from typing import Any as _Any

from optax_dls._util import versions as _versions

_versions.check()  # before the rest: a clear ImportError when jax, jaxlib or optax is too old

from optax_dls import _policies
from optax_dls import checkpoint as checkpoint  # public submodules
from optax_dls import config as config
from optax_dls import group_scale as group_scale
from optax_dls import writers as writers
from optax_dls._access.find import find_state
from optax_dls._access.loss import scale_loss
from optax_dls._access.metrics import metrics
from optax_dls._access.names import nonfinite_leaves
from optax_dls._access.reset import reset_scale
from optax_dls._core import record as _record
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
  static_policy,
)
from optax_dls._util import locate_report as _locate_report
from optax_dls._util.locate_report import LocateReport, Operation, ScopeHeadroom

__version__ = "0.1.0"

# Not public: the docstring examples of _core/scalers.py, _policies/base.py and
# _policies/dynamic.py still read the scale through it; it goes with them. The public way
# is find_state(opt_state).loss_scale.
from optax_dls._access.loss import loss_scale as loss_scale

_state.ON_INIT.append(_flax_serialization.register)  # flax's restore into a LossScaleState

# The data types (every type a state holds, and the public ones a user keeps) pickle by
# name through ``optax_dls._new``, whatever module defines them, so that moving a private
# module never breaks such a pickle; their ``__module__`` stays where they are written.
_PICKLED: dict[str, _Any] = {
  t.__name__: t
  for t in (
    LossScaleState,
    _record.NonFiniteRecord,
    _policies.DynamicScaleState,
    _policies.AmaxScaleState,
    _policies.FallbackState,
    _policies.SkipsAtMinScaleState,
    _underflow.UnderflowState,
    _recompute_stats.RecomputeState,
    GradStats,
    CastPolicy,
    SkipAlerts,
    LocateReport,
    Operation,
    ScopeHeadroom,
  )
}


def _new(name: str, *args: _Any) -> _Any:
  """The object of the pickled type ``name`` (a key of ``_PICKLED``), as ``__new__`` makes it;
  pickle then restores its state."""
  cls = _PICKLED[name]
  return cls.__new__(cls, *args)


def _by_name(obj: _Any) -> tuple[_Any, ...]:
  """``obj``'s own reduction, with its class named for :func:`_new` instead of by module."""
  _newobj, (cls, *args), *rest = obj.__reduce_ex__(4)
  return (_new, (cls.__name__, *args), *rest)


for _type in _PICKLED.values():
  _copyreg.pickle(_type, _by_name)

# The modules that held the data types before the package had folders: a state pickled then
# still loads.
for _old, _module in {
  "_state": _state,
  "_localisation": _record,
  "_underflow": _underflow,
  "_recompute_stats": _recompute_stats,
  "_casting": _casting,
  "_alerts": _alerts,
  "_headroom": _locate_report,
}.items():
  _sys.modules.setdefault(f"{__name__}.{_old}", _module)
  globals().setdefault(_old, _module)

__all__ = [
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
  "locate",
  "loss_scaled",
  "metrics",
  "no_loss_scale",
  "nonfinite_leaves",
  "noop_policy",
  "recompute_stats",
  "reset_scale",
  "scale_loss",
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
  if name in _ON_USE:
    import importlib

    return importlib.import_module(f"optax_dls.{name}")
  raise AttributeError(f"module 'optax_dls' has no attribute {name!r}")
