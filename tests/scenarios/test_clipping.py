"""Gradient clipping inside the loss scaling clips the *unscaled* gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

CLIP = 0.5
GRADS = [
  {"w": jnp.array([3.0, -4.0], jnp.float32), "b": jnp.array(1.5, jnp.float32)},
  {"w": jnp.array([0.1, 0.2], jnp.float32), "b": jnp.array(-0.05, jnp.float32)},
]


def _inner():
  return optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.25))


def _updates(tx, scale):
  params = jax.tree.map(jnp.zeros_like, GRADS[0])
  state = tx.init(params)
  step = jax.jit(tx.update)
  out = []
  for g in GRADS:
    scaled = jax.tree.map(lambda x: x * jnp.float32(scale), g)
    updates, state = step(scaled, state, params)
    out.append(updates)
  return out


@pytest.mark.parametrize("make", ["static", "dynamic"])
def test_clip_sees_unscaled_gradients_at_every_scale(make, lowering):
  assert float(optax.tree.norm(GRADS[0])) > CLIP > float(optax.tree.norm(GRADS[1]))
  reference = _updates(_inner(), 1.0)  # no loss scaling at all
  np.testing.assert_allclose(optax.tree.norm(reference[0]), 0.25 * CLIP, rtol=1e-6)  # clipped
  for scale in (1.0, 2.0**10, 2.0**20):
    if make == "static":
      tx = optax_dls.static_loss_scale(_inner(), scale, skip_lowering=lowering)
    else:
      tx = optax_dls.dynamic_loss_scale(
        _inner(), init_scale=scale, max_scale=scale, skip_lowering=lowering
      )
    got = _updates(tx, scale)
    for u, r in zip(got, reference):
      jax.tree.map(np.testing.assert_array_equal, u, r)


def test_clipping_outside_the_loss_scaling_clips_scaled_gradients(lowering):
  # The wrong order, for contrast: the clip sees S * g, so the update depends on S.
  wrong = [
    optax.chain(
      optax.clip_by_global_norm(CLIP),
      optax_dls.static_loss_scale(optax.sgd(1.0), s, skip_lowering=lowering),
    )
    for s in (1.0, 2.0**10)
  ]
  small = [_updates(tx, s)[1] for tx, s in zip(wrong, (1.0, 2.0**10))]
  assert not np.allclose(small[0]["w"], small[1]["w"])
