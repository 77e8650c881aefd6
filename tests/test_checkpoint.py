"""Orbax checkpoints of a loss-scaled optimizer state: exact round trip, resume, layout errors."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls


def _tx():
  return optax_dls.dynamic_loss_scale(optax.adam(0.01), init_scale=2.0**10, growth_interval=2)


def _grads(step, w):
  g = jnp.sin(w + step.astype(jnp.float32))
  return jnp.where(step % 4 == 2, jnp.inf, g)  # every 4th step overflows


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _step(w, state, step):
  scaled = _grads(step, w) * optax_dls.find_state(state).loss_scale
  updates, state = _tx().update(scaled, state, w)
  return optax.apply_updates(w, updates), state


def _run(w, state, steps):
  for i in steps:
    w, state = _step(w, state, jnp.int32(i))
  return w, state


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


def _fresh(w_like):
  w = jnp.zeros_like(w_like)
  return w, jax.jit(_tx().init)(w)


@pytest.fixture
def manager(tmp_path):
  with ocp.CheckpointManager(tmp_path) as mgr:
    yield mgr


def _save(manager, step, tree):
  manager.save(step, args=ocp.args.StandardSave(tree))
  manager.wait_until_finished()


def test_resume_under_8_device_sharding_equals_uninterrupted_run(manager):
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  sharding = NamedSharding(mesh, P("x"))
  w0 = jax.device_put(jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4), sharding)

  def start():
    w = jnp.copy(w0)
    return w, jax.jit(_tx().init)(w)

  w_ref, s_ref = _run(*start(), range(8))  # uninterrupted
  w, s = _run(*start(), range(5))
  _save(manager, 5, {"params": w, "opt_state": s})
  shardings = jax.tree.map(lambda x: x.sharding, {"params": w, "opt_state": s})
  del w, s
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    {"params": w_ref, "opt_state": s_ref},
  )
  restored = optax_dls.checkpoint.restore(manager, target)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert got.sharding.is_equivalent_to(want, got.ndim)
  assert restored["params"].sharding.spec == P("x")
  assert int(optax_dls.metrics(restored["opt_state"])["skip_count"]) == 1
  w, s = _run(restored["params"], restored["opt_state"], range(5, 8))
  _assert_same((w, s), (w_ref, s_ref))


def test_restore_changes_nothing_and_next_step_grows(manager):
  # Failure kind 7 of docs/design.md: S=1024, tracker 1, interval 2; restore; one clean step.
  w, state = _fresh(jnp.zeros(3))
  w, state = _run(w, state, [0])
  st = optax_dls.find_state(state)
  assert float(st.loss_scale) == 1024.0 and int(st.policy_state.growth_tracker) == 1
  saved = jax.tree.map(jnp.copy, {"params": w, "opt_state": state})
  _save(manager, 1, saved)
  restored = optax_dls.checkpoint.restore(manager, jax.tree.map(jnp.zeros_like, saved), step=1)
  _assert_same(restored, saved)
  assert isinstance(restored["opt_state"], optax_dls.LossScaleState)
  _, state = _run(restored["params"], restored["opt_state"], [1])
  st = optax_dls.find_state(state)
  assert float(st.loss_scale) == 2048.0 and int(st.policy_state.growth_tracker) == 0


def test_layout_mismatch_says_what_to_do(manager):
  w = jnp.ones(3)
  plain, scaled = optax.adam(0.1).init(w), _tx().init(w)
  _save(manager, 0, {"params": w, "opt_state": plain})
  _save(manager, 1, {"params": w, "opt_state": scaled})
  with pytest.raises(
    ValueError,
    match=r"(?s)checkpoint holds none.*into_loss_scaled\(raw, target\)"
    r".*restore_checkpoint\(directory, target=None\)",
  ):
    optax_dls.checkpoint.restore(manager, {"params": w, "opt_state": scaled}, step=0)
  with pytest.raises(
    ValueError, match=r"(?s)the target holds none.*find_state\(restored\).inner_state"
  ):
    optax_dls.checkpoint.restore(manager, {"params": w, "opt_state": plain}, step=1)
  # The documented migration: plain adam checkpoint -> loss-scaled optimizer.
  inner = optax_dls.checkpoint.restore(manager, {"params": w, "opt_state": plain}, step=0)
  migrated = scaled._replace(inner_state=inner["opt_state"])
  _assert_same(optax_dls.find_state(migrated).inner_state, plain)


@pytest.mark.parametrize("bad", [None, 3, {"step": 1}])
def test_manager_must_be_an_orbax_checkpoint_manager_or_a_directory(bad):
  w = jnp.ones(3)
  with pytest.raises(TypeError, match="manager must be an orbax.checkpoint.CheckpointManager"):
    optax_dls.checkpoint.restore(bad, {"params": w, "opt_state": _tx().init(w)})


def test_a_directory_that_does_not_exist_is_named(tmp_path):
  w = jnp.ones(3)
  with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
    optax_dls.checkpoint.restore(tmp_path / "none", {"params": w, "opt_state": _tx().init(w)})


@pytest.mark.parametrize(
  "step, error, match",
  [
    (1.0, TypeError, "step must be an int"),
    ("1", TypeError, "step must be an int"),
    (True, TypeError, "step must be an int"),
    (-1, ValueError, "step must be >= 0"),
    (7, FileNotFoundError, r"no checkpoint at step 7 .*saved steps: \[1\]"),
  ],
)
def test_bad_step_is_named(manager, step, error, match):
  w = jnp.ones(3)
  tree = {"params": w, "opt_state": _tx().init(w)}
  _save(manager, 1, tree)
  with pytest.raises(error, match=match):
    optax_dls.checkpoint.restore(manager, tree, step=step)
  _assert_same(optax_dls.checkpoint.restore(manager, tree, step=np.int64(1)), tree)


@pytest.mark.parametrize("target", [None, {}, {"params": "w"}])
def test_target_must_be_a_pytree_of_arrays(manager, target):
  w = jnp.ones(3)
  _save(manager, 1, {"params": w, "opt_state": _tx().init(w)})
  with pytest.raises(TypeError, match="target must be a pytree of arrays"):
    optax_dls.checkpoint.restore(manager, target)


def test_a_target_whose_parameters_differ_is_told_which_leaves_differ(manager):
  w = {"w": jnp.ones(3)}
  _save(manager, 0, {"params": w, "opt_state": _tx().init(w)})
  wb = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  with pytest.raises(ValueError) as err:
    optax_dls.checkpoint.restore(manager, {"params": wb, "opt_state": _tx().init(wb)}, step=0)
  message = str(err.value).split("\nOrbax:")[0]
  assert "only in the target (3): opt_state.inner_state.0.mu.b" in message
  assert "params.b" in message and "only in the checkpoint" not in message
  assert "fields" not in message  # no list of the loss-scale state's fields, the same both sides
  w4 = {"w": jnp.ones(4)}
  with pytest.raises(
    ValueError, match=r"shapes differ \(3\): .*params.w: checkpoint \(3,\), target \(4,\)"
  ):
    optax_dls.checkpoint.restore(manager, {"params": w4, "opt_state": _tx().init(w4)}, step=0)


def test_into_loss_scaled_moves_a_plain_optimizer_state_inside(manager):
  w = jnp.linspace(-1.0, 1.0, 3)
  plain = optax.adam(0.01)
  state = plain.init(w)
  for _ in range(3):
    _, state = plain.update(jnp.sin(w), state, w)
  _save(manager, 3, {"params": w, "opt_state": state})
  target = {"params": jnp.zeros(3), "opt_state": _tx().init(jnp.zeros(3))}
  with pytest.raises(
    ValueError,
    match=r"optax_dls.checkpoint.into_loss_scaled\(raw, target\), with raw "
    r".*manager.restore\(step\)",
  ):
    optax_dls.checkpoint.restore(manager, target, step=3)
  moved = optax_dls.checkpoint.into_loss_scaled(manager.restore(3), target)
  _assert_same(moved["opt_state"].inner_state, state)
  _assert_same(moved["params"], w)
  assert (
    float(optax_dls.find_state(moved).loss_scale) == 2.0**10
  )  # the loss-scale state: the target's
  wider = {"params": jnp.zeros(4), "opt_state": _tx().init(jnp.zeros(4))}
  with pytest.raises(ValueError, match=r"shapes differ \(3\): opt_state.0.mu: checkpoint \(3,\)"):
    optax_dls.checkpoint.into_loss_scaled(manager.restore(3), wider)
  with pytest.raises(ValueError, match="target must hold exactly one LossScaleState"):
    optax_dls.checkpoint.into_loss_scaled(manager.restore(3), {"params": w, "opt_state": state})


# --- a checkpoint of flax's DynamicScale ------------------------------------------------------


class _Old(train_state.TrainState):
  """flax's ImageNet example's state: batch statistics and a DynamicScale beside the optimizer."""

  batch_stats: Any
  dynamic_scale: flax_dynamic_scale.DynamicScale


class _New(train_state.TrainState):
  """The same state ported to a loss-scaled optimizer."""

  batch_stats: Any


def _dynamic_scale_checkpoint():
  """A flax TrainState with batch_stats and a DynamicScale after 5 steps, and its ported layout."""
  params = {"w": jnp.linspace(-1.0, 1.0, 3)}
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01))
  old = _Old.create(
    apply_fn=None,
    params=params,
    tx=inner,
    batch_stats={"mean": jnp.zeros(3)},
    dynamic_scale=flax_dynamic_scale.DynamicScale(growth_interval=3, scale=2.0**12),
  )
  for i in range(5):
    ds = old.dynamic_scale.value_and_grad(lambda p, k=i + 1: jnp.sum(jnp.sin(p["w"]) * k))
    ds, _, _, grads = ds(old.params)
    old = old.apply_gradients(grads=grads, dynamic_scale=ds, batch_stats={"mean": grads["w"]})
  tx = optax_dls.loss_scaled(inner, optax_dls.config.preset("flax", growth_interval=3))
  return old, _New.create(apply_fn=None, params=params, tx=tx, batch_stats={"mean": jnp.zeros(3)})


def _assert_ported(ported, old):
  _assert_same(ported.params, old.params)
  _assert_same(ported.batch_stats, old.batch_stats)
  _assert_same(optax_dls.find_state(ported).inner_state, old.opt_state)  # moments and count
  st = optax_dls.find_state(ported)
  assert float(st.loss_scale) == float(old.dynamic_scale.scale)
  assert int(st.policy_state.growth_tracker) == int(old.dynamic_scale.fin_steps) == 5 % 4
  assert int(ported.step) == int(old.step) == 5


def test_a_dynamic_scale_checkpoint_is_refused_by_restore_and_converted(manager):
  import optax_dls.flax as dls_flax

  old, new = _dynamic_scale_checkpoint()
  _save(manager, 5, old)
  with pytest.raises(
    ValueError,
    match=r"(?s)a flax DynamicScale at dynamic_scale.*"
    r"optax_dls.flax.from_dynamic_scale\(manager.restore\(step\), target\)",
  ):
    optax_dls.checkpoint.restore(manager, new, step=5)
  _assert_ported(dls_flax.from_dynamic_scale(manager.restore(5), new), old)


def test_a_dynamic_scale_checkpoint_of_flax_checkpoints_is_converted(tmp_path):
  from flax.training import checkpoints

  import optax_dls.flax as dls_flax

  old, new = _dynamic_scale_checkpoint()
  checkpoints.save_checkpoint(tmp_path, old, step=5)
  raw = checkpoints.restore_checkpoint(tmp_path, target=None)
  _assert_ported(dls_flax.from_dynamic_scale(raw, new), old)
  with pytest.raises(TypeError, match="'dynamic_scale' entry"):
    dls_flax.from_dynamic_scale({"params": raw["params"]}, new)
