"""Loss-scale policies that reproduce the scale trajectories of other frameworks.

Each preset returns a :class:`~optax_dls.LossScalePolicy` whose scale, given the same
sequence of finite / non-finite steps, equals the reference implementation's
scale bit for bit, as long as the reference stays inside ``[2**-126, 2**126]``
(the range of every optax_dls scale, where ``1/S`` is a normal float32
number). Where each reference leaves that range, and the other conditions for
exactness, are listed per preset and in ``docs/policies.md``.

References (read from the installed sources):
  PyTorch ``torch/amp/grad_scaler.py`` and ``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``;
  Megatron-LM ``megatron/core/optimizer/grad_scaler.py``;
  DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``;
  Keras 3 ``keras/src/optimizers/loss_scale_optimizer.py``;
  jmp ``jmp/_src/loss_scale.py``; flax ``flax/training/dynamic_scale.py``.

The rule itself is dynamic loss scaling, Micikevicius et al. (2018), *Mixed
Precision Training*, Sec. 3.2.
"""

from optax_dls._policies.presets import (
  deepspeed_policy,
  flax_policy,
  jmp_policy,
  keras_policy,
  megatron_policy,
  torch_policy,
)

__all__ = [
  "deepspeed_policy",
  "flax_policy",
  "jmp_policy",
  "keras_policy",
  "megatron_policy",
  "torch_policy",
]
