"""A float16 loss is said at trace time, with the cast that fixes it: its backward pass
starts at the loss scale in float16, inf from 2**16 on."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {"w": jnp.ones(3)}


def _tx():
  return optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**16)


def _per_example(p):
  return (p["w"].astype(jnp.float16) * 0.25) ** 2


def test_a_float16_loss_is_said_with_the_cast_and_the_cast_fixes_it():
  state = _tx().init(PARAMS)
  half = lambda p: optax_dls.scale_loss(optax_dls.full_precision(jnp.mean)(_per_example(p)), state)
  with pytest.warns(UserWarning, match=r"float16.*astype\(jnp.float32\)") as told:
    grads = jax.jit(jax.grad(half))(PARAMS)
  assert {w.filename for w in told} == {__file__}
  assert not np.all(np.isfinite(grads["w"]))  # what the warning says: inf at 2**16
  cast = lambda p: optax_dls.scale_loss(jnp.mean(_per_example(p).astype(jnp.float32)), state)
  mean32 = optax_dls.full_precision(jnp.mean, output_dtype=jnp.float32)
  wrapped = lambda p: optax_dls.scale_loss(mean32(_per_example(p)), state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for fixed in (cast, wrapped):  # the two casts the warning names
      grads = jax.jit(jax.grad(fixed))(PARAMS)
      assert np.all(np.isfinite(grads["w"]))
    for dtype in (jnp.bfloat16, jnp.float32):
      optax_dls.scale_loss(jnp.ones((), dtype), state)


def test_value_and_grad_says_it_at_the_users_line():
  tx = _tx()
  grad_fn = optax_dls.value_and_grad(lambda p: jnp.mean(_per_example(p)), tx)
  with pytest.warns(UserWarning, match="the loss is float16") as told:
    jax.jit(grad_fn)(tx.init(PARAMS), PARAMS)
  assert {w.filename for w in told} == {__file__}
