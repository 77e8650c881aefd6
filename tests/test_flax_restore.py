"""flax's own restore into a loss-scaled target: a checkpoint written without loss scaling is
carried into the inner state or refused, never restored with a fresh optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

serialization = pytest.importorskip("flax.serialization")
checkpoints = pytest.importorskip("flax.training.checkpoints")
train_state = pytest.importorskip("flax.training.train_state")
dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}


def _stepped(tx):
  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
  return state.apply_gradients(grads={"w": jnp.ones(3)})


def _target():
  return train_state.TrainState.create(
    apply_fn=None, params=PARAMS, tx=optax_dls.dynamic_loss_scale(optax.adamw(1e-3))
  )


def test_restore_checkpoint_of_a_plain_optimizer_into_a_loss_scaled_target_raises(tmp_path):
  checkpoints.save_checkpoint(str(tmp_path), _stepped(optax.adamw(1e-3)), step=1)
  with pytest.raises(ValueError, match="into_loss_scaled"):
    checkpoints.restore_checkpoint(str(tmp_path), _target())


def test_from_state_dict_carries_a_plain_optimizer_state_into_the_inner_state():
  plain = _stepped(optax.adamw(1e-3))
  restored = serialization.from_state_dict(_target(), serialization.to_state_dict(plain))
  lss = restored.opt_state
  assert int(lss.inner_state[0].count) == 1 and int(lss.num_steps) == 0
  np.testing.assert_array_equal(lss.inner_state[0].nu["w"], plain.opt_state[0].nu["w"])
  assert float(optax_dls.find_state(lss).loss_scale) == 2.0**15  # the target's init_scale


def test_a_loss_scaled_checkpoint_still_restores_through_flax(tmp_path):
  saved = _stepped(optax_dls.dynamic_loss_scale(optax.adamw(1e-3)))
  checkpoints.save_checkpoint(str(tmp_path), saved, step=1)
  restored = checkpoints.restore_checkpoint(str(tmp_path), _target())
  assert jax.tree.all(jax.tree.map(np.array_equal, restored.opt_state, saved.opt_state))
  from_bytes = serialization.from_bytes(_target(), serialization.to_bytes(saved))
  assert int(from_bytes.opt_state.inner_state[0].count) == 1


class _DynamicScaleState(train_state.TrainState):  # flax's ImageNet example's state
  dynamic_scale: dynamic_scale.DynamicScale


def test_restore_checkpoint_of_a_dynamic_scale_state_into_the_port_raises(tmp_path):
  old = _DynamicScaleState.create(
    apply_fn=None,
    params=PARAMS,
    tx=optax.adam(1e-3),
    dynamic_scale=dynamic_scale.DynamicScale(scale=2.0**12),
  )
  checkpoints.save_checkpoint(str(tmp_path), old.apply_gradients(grads={"w": jnp.ones(3)}), 1)
  with pytest.raises(ValueError, match=r"optax_dls\.flax\.from_dynamic_scale\(raw, target\)"):
    checkpoints.restore_checkpoint(str(tmp_path), _target())


def test_a_round_trip_of_a_trained_state_through_flax_serialization_is_not_refused():
  import flax.serialization as fs

  tx = optax_dls.dynamic_loss_scale(optax.adam(0.1))
  p = {"w": jnp.ones(2)}
  state = tx.update({"w": jnp.ones(2)}, tx.init(p), p)[1]
  for s in (state, optax_dls.reset_scale(state, 1024.0)):
    back = fs.from_state_dict(s, fs.to_state_dict(s))
    assert float(back.loss_scale) == float(s.loss_scale) and int(back.num_steps) == 1
