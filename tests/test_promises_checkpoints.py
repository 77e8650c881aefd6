"""docs/guide/checkpoints.md and docs/integrations.md (Orbax checkpoints), sentence by sentence:
the promises no other test holds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optax_dls
import optax_dls.checkpoint
from optax_dls import _policies

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}


def _layout(tree):
  return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _save(directory, tree, step=1):
  with ocp.CheckpointManager(directory) as manager:
    manager.save(step, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()


def _bits(tree):
  return [(x.dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def test_the_state_layout_is_the_same_for_every_kind_lowering_and_wrapper():
  """checkpoints.md: the layout is the same for dynamic_loss_scale, static_loss_scale and
  no_loss_scale (the same inner optimizer, the same policy wrappers) and either skip_lowering."""
  adam = optax.adam(1e-3)
  same = [
    optax_dls.dynamic_loss_scale(adam),
    optax_dls.dynamic_loss_scale(adam, skip_lowering="cond", init_scale=8.0),
    optax_dls.dynamic_loss_scale(adam, skip_lowering="where", hysteresis=3),
    optax_dls.static_loss_scale(adam, 2.0**12),
    optax_dls.static_loss_scale(adam, 2.0**12, skip_lowering="where"),
    optax_dls.no_loss_scale(adam),
  ]
  layouts = [_layout(tx.init(PARAMS)) for tx in same]
  assert all(layout == layouts[0] for layout in layouts)
  wrapped = [
    optax_dls.loss_scaled(adam, optax_dls.fp32_fallback(policy, after=3, steps=5))
    for policy in (optax_dls.dynamic_policy(), _policies.static_policy(8.0))
  ]
  first, second = (_layout(tx.init(PARAMS)) for tx in wrapped)
  assert first == second and first != layouts[0]  # the wrapper's own fields, on both sides


def test_a_dtype_that_differs_is_converted_and_listed_beside_a_difference_of_layout(tmp_path):
  """checkpoints.md: restore keeps the target's dtypes; a dtype that differs alone is
  converted, and is listed with the leaves that differ when the layout differs too."""
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  _save(tmp_path, {"params": PARAMS, "opt_state": tx.init(PARAMS)})
  half = {"w": PARAMS["w"].astype(jnp.float16)}
  restored = optax_dls.checkpoint.restore(tmp_path, {"params": half, "opt_state": tx.init(PARAMS)})
  assert restored["params"]["w"].dtype == jnp.float16
  np.testing.assert_array_equal(restored["params"]["w"], half["w"])
  wider = {"w": half["w"], "b": jnp.zeros(2)}
  with pytest.raises(ValueError) as err:
    optax_dls.checkpoint.restore(tmp_path, {"params": wider, "opt_state": tx.init(PARAMS)})
  message = str(err.value).split("\nOrbax:")[0]
  assert "only in the target (1): params.b" in message
  assert "dtypes differ (1): params.w: checkpoint float32, target float16" in message


def test_the_first_update_settles_a_restored_scale_for_the_transformation(tmp_path):
  """checkpoints.md: the scale comes back as saved; the first update unscales by it and then
  applies the new transformation's rule (1 under no_loss_scale, a lowered max_scale at
  once); restore takes the directory or a CheckpointManager."""
  trained = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  _save(tmp_path, {"params": PARAMS, "opt_state": trained.init(PARAMS)})
  for tx, scale in [
    (optax_dls.no_loss_scale(optax.sgd(0.1)), 1.0),
    (optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0, max_scale=2.0**12), 2.0**12),
  ]:
    target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    by_directory = optax_dls.checkpoint.restore(tmp_path, target)
    with ocp.CheckpointManager(tmp_path) as manager:
      by_manager = optax_dls.checkpoint.restore(manager, target)
    assert _bits(by_directory) == _bits(by_manager)
    assert float(optax_dls.find_state(by_directory).loss_scale) == 2.0**15  # as saved
    grads = {"w": jnp.full(3, 2.0**15)}
    updates, state = tx.update(grads, by_directory["opt_state"], PARAMS)
    np.testing.assert_allclose(updates["w"], [-0.1] * 3)  # unscaled by the saved scale
    assert float(optax_dls.find_state(state).loss_scale) == scale


def test_into_loss_scaled_refuses_a_leaf_on_one_side_only(tmp_path):
  """checkpoints.md: a leaf on one side only, or of another shape, is an error, never a
  default; the loss scale starts at init_scale."""
  plain = optax.adam(1e-3)
  _save(tmp_path, {"params": PARAMS, "opt_state": plain.init(PARAMS)})
  tx = optax_dls.dynamic_loss_scale(plain, init_scale=2.0**7)
  with ocp.CheckpointManager(tmp_path) as manager:
    raw = manager.restore(1)
  target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
  assert (
    float(optax_dls.find_state(optax_dls.checkpoint.into_loss_scaled(raw, target)).loss_scale)
    == 2.0**7
  )
  more = {"w": PARAMS["w"], "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"only in the target .*params\.b"):
    optax_dls.checkpoint.into_loss_scaled(raw, {"params": more, "opt_state": tx.init(more)})
  fewer = dict(raw, extra=np.zeros(2, np.float32))
  with pytest.raises(ValueError, match=r"only in the checkpoint .*extra"):
    optax_dls.checkpoint.into_loss_scaled(fewer, target)


def test_under_no_loss_scale_a_state_restored_without_tx_gives_the_bare_first_update(tmp_path):
  """checkpoints.md: without tx the first update unscales by the saved S, under
  no_loss_scale too, and settles the scale to 1."""
  dynamic = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  _save(tmp_path, {"params": PARAMS, "opt_state": dynamic.init(PARAMS)})
  tx = optax_dls.no_loss_scale(optax.sgd(0.1))
  raw = optax_dls.checkpoint.restore(tmp_path, {"params": PARAMS, "opt_state": tx.init(PARAMS)})
  assert float(raw["opt_state"].loss_scale) == 2.0**15
  bare, _ = optax.sgd(0.1).update({"w": jnp.ones(3)}, optax.sgd(0.1).init(PARAMS))

  def first_update(state):
    grads = jax.grad(lambda p: optax_dls.scale_loss(jnp.sum(p["w"]), state))(PARAMS)
    return tx.update(grads, state, PARAMS)

  updates, state = first_update(raw["opt_state"])
  np.testing.assert_array_equal(updates["w"], bare["w"])
  assert float(state.loss_scale) == 1.0
  np.testing.assert_array_equal(first_update(state)[0]["w"], bare["w"])


def test_into_loss_scaled_refuses_an_abstract_loss_scale_state_and_takes_abstract_params():
  """into_loss_scaled docstring: target may hold jax.ShapeDtypeStruct leaves, but the
  loss-scale state's own fields are kept from it, so they must be arrays: a TypeError says
  so, never a state of ShapeDtypeStructs."""
  raw = {
    "params": {"w": np.ones(3, np.float32)},
    "opt_state": [{"count": np.int32(3), "mu": {"w": np.zeros(3)}, "nu": {"w": np.zeros(3)}}, None],
  }
  tx = optax_dls.dynamic_loss_scale(optax.adam(0.1))
  abstract = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
  )
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match=r"loss-scale state at opt_state must hold arrays"):
    optax_dls.checkpoint.into_loss_scaled(raw, abstract({"params": PARAMS, "opt_state": state}))
  target = {
    "params": abstract(PARAMS),
    "opt_state": state._replace(inner_state=abstract(state.inner_state)),
  }
  moved = optax_dls.checkpoint.into_loss_scaled(raw, target)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(moved))
  assert int(moved["opt_state"].inner_state[0].count) == 3
  assert float(optax_dls.find_state(moved).loss_scale) == 2.0**15
