"""docs/guide/flax.md and docs/integrations.md (Flax), sentence by sentence: the promises no
other test holds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import optax_dls
import optax_dls.flax


def _train_state(params, axis_name=None):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**4, axis_name=axis_name)
  return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)


def test_the_readers_take_an_optimizer_its_opt_state_or_a_train_state_and_give_arrays():
  """integrations.md: metrics, loss_scale and find_state accept the nnx.Optimizer, its
  opt_state or the TrainState directly and return plain arrays."""
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax_dls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  state = _train_state({"w": jnp.ones(2)})
  for holder, scale in [(optimizer, 2.0**15), (optimizer.opt_state, 2.0**15), (state, 2.0**4)]:
    assert isinstance(optax_dls.find_state(holder).loss_scale, jax.Array)
    assert float(optax_dls.find_state(holder).loss_scale) == scale
    metrics = optax_dls.metrics(holder)
    assert all(isinstance(v, jax.Array) for v in metrics.values())
    found = optax_dls.find_state(holder)
    assert isinstance(found, optax_dls.LossScaleState)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(found))


@pytest.mark.parametrize("check_vma", [False, True])
def test_axis_name_averages_the_gradients_and_not_the_loss(check_vma):
  """flax.md:Several devices: axis_name averages the gradients over the axis with pmean
  (the loss is not averaged); under shard_map with check_vma=True JAX's transpose has
  summed the gradient of a replicated parameter already, and pmean leaves that sum."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
  x = jnp.arange(1.0, 5.0)
  state = _train_state({"w": jnp.float32(0.5)}, axis_name="batch")  # as the page says
  grad_fn = optax_dls.flax.value_and_grad(lambda p, x: jnp.sum(p["w"] * x), axis_name="batch")

  def local(state, x):
    (loss, grads), _ = grad_fn(state, state.params, x)
    return loss[None], grads["w"][None]

  spec = jax.tree.map(lambda _: P(), state)
  f = jax.shard_map(
    local, mesh=mesh, in_specs=(spec, P("batch")), out_specs=P("batch"), check_vma=check_vma
  )
  loss, grads = jax.jit(f)(state, x)
  np.testing.assert_array_equal(loss, 0.5 * x)  # each device's own loss, unscaled
  reduced = np.sum(x) if check_vma else np.mean(x)
  np.testing.assert_array_equal(grads, np.full(4, reduced * 2.0**4))  # scaled, alike


def test_from_dynamic_scale_checks_its_values_against_the_range_it_knows():
  """flax.from_dynamic_scale docstring: for a bare optimizer state the scale must lie in
  [2**-126, 2**126] (the next update brings it into the policy's range); NaN, a
  fractional or bool fin_steps and a traced value are refused."""
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = optax_dls.flax.from_dynamic_scale({"scale": 0.5, "fin_steps": 0}, tx.init(params))
  assert float(state.loss_scale) == 0.5
  _, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert float(state.loss_scale) == 1.0  # the policy's min_scale
  for scale in (2.0**-127, 2.0**127, float("nan")):
    with pytest.raises(ValueError, match="dynamic_scale.scale"):
      optax_dls.flax.from_dynamic_scale({"scale": scale, "fin_steps": 0}, tx.init(params))
  for steps in (1.5, True):
    with pytest.raises(TypeError, match="dynamic_scale.fin_steps must be an integer"):
      optax_dls.flax.from_dynamic_scale({"scale": 2.0, "fin_steps": steps}, tx.init(params))
  with pytest.raises(TypeError, match="dynamic_scale.scale must be a static Python number"):
    jax.jit(
      lambda s: optax_dls.flax.from_dynamic_scale({"scale": s, "fin_steps": 0}, tx.init(params))
    )(2.0)


def test_a_float16_loss_comes_back_as_fun_returned_it_and_its_scaled_value_is_no_overflow():
  """flax.value_and_grad docstring: the loss comes back unscaled, exactly what fun returned
  (float16 here), and is scaled in float32: 3 * 2**15, past float16's range, is no overflow
  and the step applies. (The promotion itself: tests/test_access.py, scale_loss.)"""
  params = {"w": jnp.ones(4, jnp.float32)}
  fun = lambda p: jnp.sum(p["w"].astype(jnp.float16) * jnp.float16(0.75))  # 3.0 in float16
  state = _train_state(params)
  state = state.replace(opt_state=optax_dls.reset_scale(state.opt_state, 2.0**15))
  (loss, grads), state = optax_dls.flax.value_and_grad(fun)(state, state.params)
  assert loss.dtype == jnp.float16 and float(loss) == 3.0
  np.testing.assert_array_equal(grads["w"], np.full(4, 0.75 * 2.0**15, np.float32))
  state = state.apply_gradients(grads=grads)
  assert not bool(optax_dls.metrics(state)["skipped"])
  np.testing.assert_allclose(state.params["w"], np.full(4, 1.0 - 0.1 * 0.75), rtol=1e-6)
