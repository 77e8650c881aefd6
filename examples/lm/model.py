"""A small decoder-only transformer over bytes, in flax linen, under a Precision policy."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lm.precision import Precision

VOCAB = 256  # byte-level tokens


class Block(nn.Module):
  """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  d_model: int
  num_heads: int
  precision: Precision

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    p = self.precision
    norm = lambda: nn.LayerNorm(dtype=p.output_dtype, param_dtype=p.param_dtype)
    dense = lambda n: nn.Dense(n, dtype=p.compute_dtype, param_dtype=p.param_dtype)
    h = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads,
      dtype=p.compute_dtype,
      param_dtype=p.param_dtype,
      force_fp32_for_softmax=jnp.dtype(p.output_dtype) == jnp.float32,
      deterministic=True,
    )(norm()(x), mask=mask)
    x = x + h
    h = dense(self.d_model)(nn.gelu(dense(4 * self.d_model)(norm()(x))))
    return x + h


class Transformer(nn.Module):
  """Decoder-only byte language model.

  Attributes:
    d_model: width of the residual stream (divisible by ``num_heads``).
    num_layers: number of transformer blocks.
    num_heads: attention heads per block.
    max_len: longest input sequence (learned positional embeddings).
    precision: the dtype policy; see :class:`lm.precision.Precision`.

  Call with int32 tokens ``[batch, time]`` (time <= max_len); returns logits
  ``[batch, time, 256]`` in ``precision.output_dtype``.
  """

  d_model: int
  num_layers: int
  num_heads: int
  max_len: int
  precision: Precision

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    p = self.precision
    embed = lambda n: nn.Embed(n, self.d_model, dtype=p.compute_dtype, param_dtype=p.param_dtype)
    x = embed(VOCAB)(tokens) + embed(self.max_len)(jnp.arange(tokens.shape[1]))[None]
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, p)(x, mask)
    x = nn.LayerNorm(dtype=p.output_dtype, param_dtype=p.param_dtype)(x)
    logits = nn.Dense(VOCAB, dtype=p.compute_dtype, param_dtype=p.param_dtype)(x)
    return logits.astype(p.output_dtype)


def token_losses(model: Transformer, params, batch: jax.Array) -> jax.Array:
  """Next-byte cross-entropy of every predicted byte in nats, float32 ``[batch, time]``.

  Args:
    model: the :class:`Transformer` (its precision decides the compute dtype).
    params: its parameters (float32 master copy).
    batch: int32 ``[batch, time + 1]`` byte windows; predicts bytes 1..time
      from bytes 0..time-1.
  """
  logits = model.apply({"params": params}, batch[:, :-1])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
  return loss.astype(jnp.float32)


def loss_fn(model: Transformer, params, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy in nats (float32 scalar); arguments as :func:`token_losses`."""
  return token_losses(model, params, batch).mean()


def loss_sum(model: Transformer, params, batch: jax.Array) -> jax.Array:
  """Summed next-byte cross-entropy in nats (float32 scalar); arguments as :func:`token_losses`.

  Divided by the token count of a whole optimizer step, it is the share of
  one micro-batch in that step's mean loss.
  """
  return token_losses(model, params, batch).sum()
