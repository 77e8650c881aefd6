"""optax_dls: dynamic loss scaling for fp16 mixed-precision training, as an optax transformation.

Method: Micikevicius et al. (2018), *Mixed Precision Training*, ICLR.
"""

from optax_dls._access import (
    applied_steps,
    find_state,
    loss_scale,
    metrics,
    reset_scale,
    scale_loss,
)
from optax_dls._checkpoint import restore_checkpoint
from optax_dls._compat import (
    deepspeed_policy,
    flax_policy,
    jmp_policy,
    keras_policy,
    megatron_policy,
    torch_policy,
)
from optax_dls._group_scale import group_scaled, group_unscale, scale_gradient
from optax_dls._amax_policy import AmaxScaleState, amax_policy
from optax_dls._config import from_config, load_config, preset, presets
from optax_dls._fallback import fallback_active, fallback_value_and_grad, select_precision
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
    apply_step,
    dynamic_loss_scale,
    loss_scaled,
    no_loss_scale,
    static_loss_scale,
)

from optax_dls import writers

__version__ = "0.1.0"

__all__ = [
    "apply_step",
    "AmaxScaleState",
    "amax_policy",
    "deepspeed_policy",
    "flax_policy",
    "group_scaled",
    "group_unscale",
    "jmp_policy",
    "keras_policy",
    "megatron_policy",
    "scale_gradient",
    "torch_policy",
    "DynamicScaleState",
    "GradStats",
    "LossScalePolicy",
    "LossScaleState",
    "all_finite",
    "fallback_active",
    "fallback_value_and_grad",
    "from_config",
    "load_config",
    "preset",
    "presets",
    "select_precision",
    "writers",
    "applied_steps",
    "dynamic_loss_scale",
    "dynamic_policy",
    "find_state",
    "loss_scale",
    "loss_scaled",
    "metrics",
    "no_loss_scale",
    "noop_policy",
    "reset_scale",
    "restore_checkpoint",
    "scale_loss",
    "static_loss_scale",
    "static_policy",
]
