"""docs/guide/equinox.md, sentence by sentence: the promises no other test holds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

eqx = pytest.importorskip("equinox")


def _trainer(tx):
  """An MLP with a function leaf, ``tx``'s state, and a jitted step: ``update`` then
  ``eqx.apply_updates``."""
  model = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.relu, key=jax.random.key(0))
  state = tx.init(eqx.filter(model, eqx.is_array))
  grad_fn = optax_dls.value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), tx)

  @eqx.filter_jit
  def step(model, state, x):
    (_, grads), state = grad_fn(state, model, x)
    updates, state = tx.update(grads, state, model)
    return eqx.apply_updates(model, updates), state

  return model, state, step


def test_multisteps_inside_trains_an_equinox_model_and_drops_a_nan_micro_batch():
  """equinox.md:Accumulation: optax.MultiSteps inside the loss scaling, as for any optax
  optimizer; its conditional takes the model's arrays, never its functions."""
  inner = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=2)
  model, state, step = _trainer(optax_dls.dynamic_loss_scale(inner))
  x = jnp.ones((3, 4))
  moved = []
  for i in range(5):  # the second micro-batch holds an inf: dropped, the window waits
    before = model.layers[0].weight
    model, state = step(model, state, x.at[0, 0].set(jnp.inf) if i == 1 else x)
    moved.append(not np.array_equal(model.layers[0].weight, before))
    assert model.activation is jax.nn.relu
  assert moved == [False, False, True, False, True]
  assert int(optax_dls.metrics(state)["skip_count"]) == 1


def test_multisteps_inside_no_loss_scale_trains_an_equinox_model():
  """equinox.md:Accumulation, under no_loss_scale (bfloat16) too: the passthrough step also
  hands MultiSteps the model's arrays, never its functions."""
  tx = optax_dls.no_loss_scale(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))
  model, state, step = _trainer(tx)
  moved = []
  for _ in range(4):
    before = model.layers[0].weight
    model, state = step(model, state, jnp.ones((3, 4)))
    moved.append(not np.array_equal(model.layers[0].weight, before))
    assert model.activation is jax.nn.relu
  assert moved == [False, True, False, True]
