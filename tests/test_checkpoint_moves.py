"""A checkpoint restored into another transformation trains under that one's rule.

The state holds what was learned (the scale, the counters, the record); the transformation
it is restored into supplies its configuration: under ``no_loss_scale`` the loss is
multiplied by the restored scale once and the updates are the bare optimizer's, a lowered
``max_scale`` applies at the first update, a raised one lets the scale grow, a dynamic
transformation restored from a no-op or a static state starts from the scale that state had.
Checkpoints of the earlier layouts (whose state held ``last_step_finite`` and a record of
bit sets, or also ``min_scale`` and ``max_scale``) still restore.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optax_dls

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}


def _loss(params, x):
  return jnp.sum(jnp.square(params["w"] * x))


def _save(directory, tree):
  with ocp.CheckpointManager(directory) as manager:
    manager.save(0, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()


def _trained(tx, steps=3):
  """``tx``'s state after a few quick-start steps."""
  params, state = PARAMS, tx.init(PARAMS)
  for i in range(steps):
    params, state = _quick_start_step(tx, params, state, jnp.float32(i + 1))
  return params, state


def _quick_start_step(tx, params, state, x):
  """The quick start's loop: the loss times scale_loss, then update and apply."""
  grads = jax.grad(lambda p: optax_dls.scale_loss(_loss(p, x), state))(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def _restore(directory, into, params, **kwargs):
  target = {"params": params, "opt_state": into.init(params)}
  return optax_dls.checkpoint.restore(directory, target, **kwargs)


def test_a_dynamic_checkpoint_under_no_loss_scale_trains_as_the_bare_optimizer(tmp_path):
  params, state = _trained(optax_dls.dynamic_loss_scale(optax.sgd(0.1)))
  assert float(state.loss_scale) == 2.0**15
  _save(tmp_path, {"params": params, "opt_state": state})
  tx = optax_dls.no_loss_scale(optax.sgd(0.1))
  state = _restore(tmp_path, tx, params)["opt_state"]
  assert float(optax_dls.find_state(state).loss_scale) == 2.0**15  # the loss is scaled by it once
  new, state = _quick_start_step(tx, params, state, jnp.float32(2.0))
  assert float(optax_dls.find_state(state).loss_scale) == 1.0
  sgd = optax.sgd(0.1)
  bare_updates, _ = sgd.update(jax.grad(_loss)(params, 2.0), sgd.init(params), params)
  bare = optax.apply_updates(params, bare_updates)
  np.testing.assert_array_equal(new["w"], bare["w"])


def test_the_first_no_loss_scale_update_sets_the_scale_to_one(tmp_path):
  params, state = _trained(optax_dls.dynamic_loss_scale(optax.sgd(0.1)))
  _save(tmp_path, {"params": params, "opt_state": state})
  tx = optax_dls.no_loss_scale(optax.sgd(0.1))
  restored = _restore(tmp_path, tx, params)  # the saved scale: the next update settles it
  assert float(restored["opt_state"].loss_scale) == 2.0**15
  _, state = tx.update(jax.tree.map(jnp.zeros_like, params), restored["opt_state"], params)
  assert float(state.loss_scale) == 1.0


def test_a_no_loss_scale_checkpoint_under_dynamic_scaling_adapts_from_its_scale(tmp_path):
  """The no-op state's S = 1 lies in the dynamic range: the scale starts there and grows;
  the range [1, 1] of the no-op transformation does not come back with it."""
  params, state = _trained(optax_dls.no_loss_scale(optax.sgd(0.1)))
  _save(tmp_path, {"params": params, "opt_state": state})
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=1)
  state = _restore(tmp_path, tx, params)["opt_state"]
  assert float(state.loss_scale) == 1.0
  for i in range(3):
    params, state = _quick_start_step(tx, params, state, jnp.float32(1.0))
    assert float(state.loss_scale) == 2.0 ** (i + 1)
  reset = optax_dls.reset_scale(state, 2.0**15)  # the earlier layout refused this
  assert float(reset.loss_scale) == 2.0**15


def test_a_lowered_max_scale_applies_at_once_and_a_raised_one_lets_the_scale_grow(tmp_path):
  params, state = _trained(optax_dls.dynamic_loss_scale(optax.sgd(0.1), max_scale=2.0**15))
  _save(tmp_path, {"params": params, "opt_state": state})
  lowered = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0, max_scale=2.0**10)
  # The first update keeps the scale within the new range.
  raw = _restore(tmp_path, lowered, params)["opt_state"]
  _, raw = _quick_start_step(lowered, params, raw, jnp.float32(1.0))
  assert float(raw.loss_scale) == 2.0**10
  raised = optax_dls.dynamic_loss_scale(optax.sgd(0.1), max_scale=2.0**20, growth_interval=1)
  state = _restore(tmp_path, raised, params)["opt_state"]
  _, state = _quick_start_step(raised, params, state, jnp.float32(1.0))
  assert float(state.loss_scale) == 2.0**16


def test_a_static_checkpoint_under_dynamic_scaling_starts_from_the_static_scale(tmp_path):
  params, state = _trained(optax_dls.static_loss_scale(optax.sgd(0.1), 2.0**12))
  _save(tmp_path, {"params": params, "opt_state": state})
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=1)
  state = _restore(tmp_path, tx, params)["opt_state"]
  _, state = _quick_start_step(tx, params, state, jnp.float32(1.0))
  assert float(state.loss_scale) == 2.0**13
  below = optax_dls.dynamic_loss_scale(optax.sgd(0.1), min_scale=2.0**14, init_scale=2.0**15)
  state = _restore(tmp_path, below, params)["opt_state"]
  _, state = _quick_start_step(below, params, state, jnp.float32(1.0))
  assert float(state.loss_scale) == 2.0**14


class _PreviousRecord(NamedTuple):
  """The non-finite record as the previous layout saved it: bit sets of the leaves."""

  step: Any
  leaves: Any
  nan: Any
  loss: Any
  overflows: Any
  names_digest: Any


class _PreviousState(NamedTuple):
  """The loss-scale state as the previous layout saved it: ``last_step_finite`` stored and
  the record a NamedTuple."""

  loss_scale: Any
  num_steps: Any
  num_skipped: Any
  consecutive_skips: Any
  last_step_finite: Any
  grad_norm: Any
  nonfinite: Any
  policy_state: Any
  inner_state: Any


class _EarlierRecord(NamedTuple):
  """The non-finite record as the earlier layout saved it: without the names' digest."""

  step: Any
  leaves: Any
  nan: Any
  loss: Any
  overflows: Any


class _EarlierState(NamedTuple):
  """The loss-scale state as the earlier layout saved it: with its policy's range."""

  loss_scale: Any
  min_scale: Any
  max_scale: Any
  num_steps: Any
  num_skipped: Any
  consecutive_skips: Any
  last_step_finite: Any
  grad_norm: Any
  nonfinite: Any
  policy_state: Any
  inner_state: Any


def _previous(state):
  """``state`` (nothing non-finite recorded) in the previous layout."""
  fields = {k: v for k, v in state._asdict().items() if k != "overflows"}
  words = jnp.zeros([1], jnp.uint32)
  fields["nonfinite"] = _PreviousRecord(
    jnp.int32(0), words, words, jnp.bool_(False), {}, jnp.uint32(0)
  )
  return _PreviousState(last_step_finite=state.last_step_finite, **fields)


def _earlier(state, low, high):
  """``state`` (nothing non-finite recorded) in the earlier layout."""
  fields = _previous(state)._asdict()
  fields["nonfinite"] = _EarlierRecord(*fields["nonfinite"][:-1])
  return _EarlierState(min_scale=jnp.float32(low), max_scale=jnp.float32(high), **fields)


@pytest.mark.parametrize("layout", ["previous", "earlier"])
def test_a_checkpoint_of_an_earlier_layout_restores_and_trains_on_unchanged(tmp_path, layout):
  tx = optax_dls.dynamic_loss_scale(optax.adam(0.01), init_scale=2.0**10, growth_interval=2)
  params, state = _trained(tx, steps=3)
  assert int(state.num_skipped) == 0  # nothing recorded: the target's fresh record is the same
  old = _previous(state) if layout == "previous" else _earlier(state, 1.0, 2.0**24)
  _save(tmp_path, {"params": params, "opt_state": old})
  restored = _restore(tmp_path, tx, params)
  for a, b in zip(
    jax.tree.leaves(restored), jax.tree.leaves({"params": params, "opt_state": state}), strict=True
  ):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  one = _quick_start_step(tx, params, state, jnp.float32(1.0))
  two = _quick_start_step(tx, restored["params"], restored["opt_state"], jnp.float32(1.0))
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
    np.testing.assert_array_equal(a, b)


def _flax_states(tx):
  from flax.training import train_state

  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
  return state.apply_gradients(grads={"w": jnp.ones(3)})


def test_restore_reads_a_directory_flax_save_checkpoint_wrote(tmp_path):
  from flax.training import checkpoints

  tx = optax_dls.dynamic_loss_scale(optax.adamw(1e-3), init_scale=2.0**10)
  saved = _flax_states(tx)
  checkpoints.save_checkpoint(str(tmp_path), saved, step=1)
  fresh = _flax_states(tx).replace(step=0, opt_state=tx.init(PARAMS))
  restored = optax_dls.checkpoint.restore(str(tmp_path), fresh)
  assert int(restored.step) == 1
  assert jax.tree.all(jax.tree.map(np.array_equal, restored.opt_state, saved.opt_state))


def test_a_plain_flax_checkpoint_under_restore_names_the_conversion_and_it_carries(tmp_path):
  """flax's save_checkpoint of a plain adamw state, restored into a loss-scaled TrainState:
  restore refuses (never a silent reset of Adam's state) and into_loss_scaled carries it."""
  from flax.training import checkpoints

  plain = _flax_states(optax.adamw(1e-3))
  checkpoints.save_checkpoint(str(tmp_path), plain, step=1)
  tx = optax_dls.dynamic_loss_scale(optax.adamw(1e-3))
  target = _flax_states(tx).replace(step=0, opt_state=tx.init(PARAMS))
  with pytest.raises(ValueError, match="into_loss_scaled"):
    optax_dls.checkpoint.restore(str(tmp_path), target)
  raw = checkpoints.restore_checkpoint(str(tmp_path), target=None)
  moved = optax_dls.checkpoint.into_loss_scaled(raw, target)
  assert int(moved.opt_state.inner_state[0].count) == 1
  np.testing.assert_array_equal(moved.opt_state.inner_state[0].mu["w"], plain.opt_state[0].mu["w"])


def test_a_tuple_handed_over_as_the_loss_says_to_pass_has_aux():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match="needs has_aux=True"):
    optax_dls.scale_loss((jnp.float32(1.0), {"tag": "t"}), state)
  grad_fn = optax_dls.value_and_grad(lambda p: (_loss(p, 1.0), {"tag": "t"}), tx)
  with pytest.raises(TypeError, match="needs has_aux=True"):
    grad_fn(state, PARAMS)


def test_a_state_of_other_labels_is_refused_naming_both():
  p2 = {"enc": jnp.ones(2), "dec": jnp.ones(2)}
  labelled = optax_dls.dynamic_loss_scale(optax.sgd(0.1), labels={"enc": "e", "dec": "d"})
  plain = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  grads = {"enc": jnp.array([jnp.inf, 1.0]), "dec": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"groups none, and this transformation labels \['d', 'e'\]"):
    labelled.update(grads, plain.init(p2), p2)
  with pytest.raises(ValueError, match=r"groups \['d', 'e'\], and this transformation labels none"):
    plain.update(grads, labelled.init(p2), p2)


def test_a_state_of_another_policy_is_refused_naming_the_fix():
  """A state of amax_policy handed to a dynamic transformation is refused before anything
  reads its policy state, naming how to start over."""
  params = {"w": jnp.ones(2)}
  amax_state = optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.amax_policy()).init(params)
  dynamic = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"AmaxScaleState.*DynamicScaleState.*tx.init\(params\)"):
    dynamic.update(params, amax_state, params)
  static_state = optax_dls.static_loss_scale(optax.sgd(0.1), 8.0).init(params)
  dynamic.update(params, static_state, params)  # the same rule's layout: accepted


SOURCES = {
  "dynamic": lambda: optax_dls.dynamic_loss_scale(optax.sgd(0.1)),
  "static": lambda: optax_dls.static_loss_scale(optax.sgd(0.1), 2.0**3),
  "no_loss_scale": lambda: optax_dls.no_loss_scale(optax.sgd(0.1)),
}
TARGETS = {
  "dynamic": (lambda: optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10), None),
  "static": (lambda: optax_dls.static_loss_scale(optax.sgd(0.1), 2.0**5), 2.0**5),
  "no_loss_scale": (lambda: optax_dls.no_loss_scale(optax.sgd(0.1)), 1.0),
}


def _restored_by(path, directory, source_tree, target_tree):
  """``target_tree`` with the values of the checkpoint of ``source_tree`` in ``directory``,
  restored by ``path`` as a user calls it, no ``tx=`` anywhere."""
  from flax import serialization
  from flax.training import checkpoints

  if path == "ours":
    return optax_dls.checkpoint.restore(directory / "orbax", target_tree)
  if path == "orbax":
    with ocp.CheckpointManager(directory / "orbax") as manager:
      return manager.restore(0, args=ocp.args.StandardRestore(target_tree))
  if path == "flax_restore_checkpoint":
    return checkpoints.restore_checkpoint(str(directory / "flax"), target_tree)
  return serialization.from_state_dict(target_tree, serialization.to_state_dict(source_tree))


@pytest.mark.parametrize("path", ["ours", "orbax", "flax_restore_checkpoint", "from_state_dict"])
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_every_restore_path_trains_under_the_new_rule_from_its_first_step(
  tmp_path, source, target, path
):
  from flax.training import checkpoints

  params, state = _trained(SOURCES[source]())
  saved = {"params": params, "opt_state": state}
  _save(tmp_path / "orbax", saved)
  checkpoints.save_checkpoint(str(tmp_path / "flax"), saved, step=0)
  make, rule_scale = TARGETS[target]
  tx = make()
  restored = _restored_by(path, tmp_path, saved, {"params": params, "opt_state": tx.init(params)})
  params, state = restored["params"], restored["opt_state"]
  sgd = optax.sgd(0.1)
  for i in range(3):
    x = jnp.float32(i + 1)
    bare = optax.apply_updates(params, sgd.update(jax.grad(_loss)(params, x), sgd.init(params))[0])
    params, state = _quick_start_step(tx, params, state, x)
    np.testing.assert_allclose(params["w"], bare["w"], rtol=1e-6)  # the bare step, every step
    want = float(saved["opt_state"].loss_scale) if rule_scale is None else rule_scale
    assert float(optax_dls.find_state(state).loss_scale) == want, (i, float(state.loss_scale))


def test_a_plain_optax_state_is_refused_naming_the_conversion_which_takes_it_in_memory():
  plain = optax.adam(0.1)
  old = plain.init(PARAMS)
  _, old = plain.update({"w": jnp.ones(3)}, old, PARAMS)
  tx = optax_dls.dynamic_loss_scale(optax.adam(0.1))
  with pytest.raises(TypeError, match=r"ScaleByAdamState.*into_loss_scaled\(old_state, tx.init"):
    tx.update({"w": jnp.ones(3)}, old, PARAMS)
  state = optax_dls.checkpoint.into_loss_scaled(old, tx.init(PARAMS))
  for got, want in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(old), strict=True):
    np.testing.assert_array_equal(got, want)
  assert float(optax_dls.find_state(state).loss_scale) == 2.0**15


def test_a_weakly_typed_scalar_of_the_target_comes_back_weakly_typed(tmp_path):
  from flax.training import train_state

  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  make = jax.jit(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=tx))
  state = jax.device_put(make(PARAMS), jax.devices()[0])  # committed, as restored arrays are
  assert jax.typeof(state.step).weak_type  # the Python int 0, through jit
  _save(tmp_path, state)

  @jax.jit
  def step(s):
    return s.replace(step=s.step + 1)

  step(state)
  for target in (state, jax.eval_shape(make, PARAMS)):
    restored = optax_dls.checkpoint.restore(tmp_path, target)
    assert jax.typeof(restored.step).weak_type and int(restored.step) == 0
    step(restored)
  assert step._cache_size() == 1  # no second program for the restored state


@pytest.mark.parametrize("how", ["scale_loss", "scale_as_an_argument"])
def test_under_no_loss_scale_a_restored_scale_is_undone_in_a_jitted_step(how):
  """Whatever way the loss was multiplied by the restored scale (scale_loss of the state, or
  the scale read outside and passed to the step), the update divides by it."""
  from flax import serialization

  source = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
  tx = optax_dls.no_loss_scale(optax.sgd(0.1))
  state = serialization.from_state_dict(tx.init(PARAMS), serialization.to_state_dict(source))
  assert float(state.loss_scale) == 2.0**15

  @jax.jit
  def step(p, s, x, scale):
    if how == "scale_loss":
      loss = lambda p: optax_dls.scale_loss(_loss(p, x), s)
    else:
      loss = lambda p: _loss(p, x) * scale
    u, s = tx.update(jax.grad(loss)(p), s, p)
    return optax.apply_updates(p, u), s

  sgd = optax.sgd(0.1)
  params = PARAMS
  for x in (jnp.float32(1.0), jnp.float32(2.0)):
    bare = optax.apply_updates(params, sgd.update(jax.grad(_loss)(params, x), sgd.init(params))[0])
    params, state = step(params, state, x, optax_dls.find_state(state).loss_scale)
    np.testing.assert_allclose(params["w"], bare["w"], rtol=1e-6)
    assert float(state.loss_scale) == 1.0


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -4.0, float("inf")])
def test_a_restored_scale_that_is_not_valid_restarts_at_the_initial_scale(bad):
  for tx, want in (
    (optax_dls.no_loss_scale(optax.sgd(1.0)), 1.0),
    (optax_dls.dynamic_loss_scale(optax.sgd(1.0)), 2.0**15),
  ):
    state = tx.init(PARAMS)._replace(loss_scale=jnp.float32(bad))
    _, settled = tx.update({"w": jnp.ones(3)}, state, PARAMS)
    assert float(settled.loss_scale) == want


def test_a_state_the_chain_moved_is_refused_saying_where_it_sits_on_each_side(tmp_path):
  """A clip chained inside the loss scaling when saved and outside it in the target: the
  message names both places, and restoring into the saving layout still works."""
  inside = optax_dls.dynamic_loss_scale(optax.chain(optax.clip(1.0), optax.adam(1e-3)))
  params, state = _trained(inside)
  _save(tmp_path, {"params": params, "opt_state": state})
  outside = optax.chain(optax.clip(1.0), optax_dls.dynamic_loss_scale(optax.adam(1e-3)))
  where = r"LossScaleState\) at opt_state\.1; the checkpoint holds it at opt_state: "
  with pytest.raises(ValueError, match=where + r"the optimizer around it changed"):
    _restore(tmp_path, outside, params)
  back = _restore(tmp_path, inside, params)
  assert int(back["opt_state"].num_steps) == 3
