"""The mixed-precision policy of the example: one frozen object passed to the model."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Precision:
  """Which dtype each part of the model uses (Micikevicius et al. 2018, Sec. 3).

  Attributes:
    param_dtype: dtype of the master parameters the optimizer updates
      (float32 in every run here).
    compute_dtype: dtype of the matmuls and of the activations between them
      (float16 for mixed precision, float32 for the reference run). Flax
      casts the float32 parameters to it inside each layer, so their
      gradients flow back through it.
    output_dtype: dtype of the numerically sensitive parts: layer norm,
      attention softmax, the logits handed to the loss, and the loss itself.
      float32 in every run, as mixed-precision practice requires.
  """

  param_dtype: jnp.dtype
  compute_dtype: jnp.dtype
  output_dtype: jnp.dtype

  @property
  def name(self) -> str:
    return jnp.dtype(self.compute_dtype).name


FP32 = Precision(param_dtype=jnp.float32, compute_dtype=jnp.float32, output_dtype=jnp.float32)
FP16 = Precision(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32)
