"""Choosing the float16 or the float32 computation inside the step, from the fp32_fallback
flag that metrics reports: ``jax.lax.cond`` on it, as the docs write the step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls


def _fallback_state(on):
  """A state whose fp32_fallback policy wrapper is on (after one skip) or off."""
  tx = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=1, steps=3)
  )
  state = tx.init({"w": jnp.ones(2)})
  if on:
    _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state)
  return state


def _loss(dtype):
  return lambda x, factor: jnp.sum(x.astype(dtype) * factor).astype(jnp.float32)


X = jnp.full(2, 0.1)  # 0.1 in float16 is 0.0999755859375
FP16, FP32 = float(jnp.float16(0.1)) * 4, float(jnp.float32(0.1)) * 4


def _chosen(opt_state, x):
  fp16_loss, fp32_loss = _loss(jnp.float16), _loss(jnp.float32)
  flag = optax_dls.metrics(opt_state)["fp32_fallback"]
  return jax.lax.cond(flag, fp32_loss, fp16_loss, x, jnp.float32(2.0))


def test_the_flag_picks_the_computation():
  np.testing.assert_allclose(float(_chosen(_fallback_state(False), X)), FP16, rtol=1e-6)
  np.testing.assert_allclose(float(_chosen(_fallback_state(True), X)), FP32, rtol=1e-6)


def test_under_jit_switching_never_recompiles():
  step = jax.jit(_chosen)
  np.testing.assert_allclose(float(step(_fallback_state(False), X)), FP16, rtol=1e-6)
  np.testing.assert_allclose(float(step(_fallback_state(True), X)), FP32, rtol=1e-6)
  assert step._cache_size() == 1
