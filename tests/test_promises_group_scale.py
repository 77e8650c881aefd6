"""The promises of the ``optax_dls.group_scale`` docstrings not held elsewhere."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

from optax_dls import group_scale

HALF = jnp.asarray([1.0009765625, 3.0, 0.1, 65504.0], jnp.float16)


def test_a_factor_that_is_no_power_of_two_is_applied_in_float32_and_rounded_once():
  wrapped = group_scale.group_scaled(lambda params: params, 0.3)
  (ct,) = jax.vjp(wrapped, jnp.zeros(4, jnp.float16))[1](HALF)
  assert ct.dtype == jnp.float16
  once = (HALF.astype(jnp.float32) * jnp.float32(0.3)).astype(jnp.float16)
  np.testing.assert_array_equal(np.asarray(ct), np.asarray(once))
  assert not np.array_equal(np.asarray(ct), np.asarray(HALF * jnp.float16(0.3)))


def test_group_unscale_is_stateless_keeps_dtypes_and_passes_non_floating_leaves():
  tx = group_scale.group_unscale(3.0, True)
  grads = {"h": HALF, "w": jnp.asarray([3.0, 1.0]), "i": jnp.asarray([3, 6], jnp.int32)}
  state = tx.init(grads)
  assert jax.tree.leaves(state) == []
  out, new = tx.update(grads, state)
  assert jax.tree.leaves(new) == []
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, grads)
  wide = (HALF.astype(jnp.float32) * jnp.float32(1 / 3)).astype(jnp.float16)
  np.testing.assert_array_equal(np.asarray(out["h"]), np.asarray(wide))
  np.testing.assert_array_equal(np.asarray(out["i"]), [3, 6])


def test_group_scaled_keeps_the_signature_of_fn():
  def fn(params, x, *, train=True):
    return params * x

  wrapped = group_scale.group_scaled(fn, 2.0)
  assert inspect.signature(wrapped) == inspect.signature(fn)
  assert wrapped.__name__ == "fn"
