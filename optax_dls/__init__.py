"""optax_dls: dynamic loss scaling for fp16 mixed-precision training, as an optax transformation.

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.
"""

from optax_dls._access import find_state, loss_scale, metrics, reset_scale, scale_loss
from optax_dls._numerics import all_finite
from optax_dls._policy import (
    DynamicScaleState,
    GradStats,
    LossScalePolicy,
    dynamic_policy,
    noop_policy,
    static_policy,
)
from optax_dls._state import LossScaleState
from optax_dls._transform import (
    dynamic_loss_scale,
    loss_scaled,
    no_loss_scale,
    static_loss_scale,
)

__version__ = "0.1.0"

__all__ = [
    "DynamicScaleState",
    "GradStats",
    "LossScalePolicy",
    "LossScaleState",
    "all_finite",
    "dynamic_loss_scale",
    "dynamic_policy",
    "find_state",
    "loss_scale",
    "loss_scaled",
    "metrics",
    "no_loss_scale",
    "noop_policy",
    "reset_scale",
    "scale_loss",
    "static_loss_scale",
    "static_policy",
]
