"""An optimizer state placed otherwise than the parameters (replicated, as a trainer's
``out_shardings`` or a restored checkpoint may place it) trains as a bare optimizer's
does: on ``Explicit`` axes the inner update's new state takes the gradients' sharding,
and the skip selects between the two without a sharding type error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls


@pytest.mark.parametrize("lowering", ["auto", "where", "cond"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_replicated_state_over_sharded_parameters_trains_and_skips(axis_type, lowering):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
  with jax.set_mesh(mesh):
    params = {
      "w": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("fsdp"))),
      "b": jnp.zeros((4,)),
    }
    bare = optax.adam(1e-2)
    tx = optax_dls.dynamic_loss_scale(bare, skip_lowering=lowering)
    state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
    bare_state = jax.device_put(bare.init(params), NamedSharding(mesh, P()))

    def loss(p, x):
      return jnp.sum(x @ p["w"] + p["b"][None])

    @jax.jit
    def step(p, s, x):
      g = jax.grad(lambda p: optax_dls.scale_loss(loss(p, x), s))(p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    @jax.jit
    def bare_step(p, s, x):
      u, s = bare.update(jax.grad(loss)(p, x), s, p)
      return optax.apply_updates(p, u), s

    x = jnp.ones((2, 16))
    p1, s1 = step(params, state, x)  # replicated state in, retraced with the new one next
    b1, bs1 = bare_step(params, bare_state, x)
    p2, s2 = step(p1, s1, x * jnp.inf)  # skipped
    p3, _ = step(p2, s2, x)
  inner1 = optax_dls.find_state(s1).inner_state
  for got, want in zip(jax.tree.leaves((p1, inner1)), jax.tree.leaves((b1, bs1)), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
  assert bool(optax_dls.metrics(s2)["skipped"])
  for got, want in zip(
    jax.tree.leaves((p2, optax_dls.find_state(s2).inner_state)),
    jax.tree.leaves((p1, inner1)),
    strict=True,
  ):
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(p3["w"], p2["w"])


@pytest.mark.parametrize("lowering", ["auto", "where", "cond"])
def test_outside_a_mesh_context_and_with_a_sharded_state_over_replicated_parameters(lowering):
  """No ``jax.set_mesh``: the arrays carry their mesh. And the other way round (a ZeRO-1
  layout): replicated parameters whose optimizer state, hence updates, are sharded; the
  updates have the bare optimizer's sharding, and a skipped step keeps the parameters'
  values."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), skip_lowering=lowering)
  for params_sharding, state_sharding in ((sharded, replicated), (replicated, sharded)):
    params = {"w": jax.device_put(jnp.ones((8, 4)), params_sharding)}
    state = tx.init(params)
    place = lambda a, s=state_sharding: jax.device_put(a, s) if a.ndim == 2 else a
    state = state._replace(inner_state=jax.tree.map(place, state.inner_state))
    grads = {"w": jax.device_put(jnp.full((8, 4), 2.0), params_sharding)}
    fused = jax.jit(lambda g, s, p: apply_step(tx, g, s, p))
    new, _ = fused(grads, state, params)
    bare = optax.adam(1e-2)
    unscaled = jax.tree.map(lambda g: g / 2.0**15, grads)  # the initial scale
    want = optax.apply_updates(params, bare.update(unscaled, bare.init(params))[0])
    np.testing.assert_allclose(new["w"], want["w"], rtol=1e-6)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    bare_state = jax.tree.map(place, bare.init(params))
    bare_updates, _ = jax.jit(bare.update)(unscaled, bare_state, params)
    assert updates["w"].sharding.is_equivalent_to(bare_updates["w"].sharding, 2)
    kept, _ = fused({"w": grads["w"] * jnp.inf}, state, params)
    np.testing.assert_array_equal(kept["w"], params["w"])
