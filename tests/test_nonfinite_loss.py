"""A loss that is not finite skips the step and backs off once, whatever path records it,
even when the gradients are finite (a data term that does not depend on the parameters)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step
from flax.training.train_state import TrainState

import optax_dls
import optax_dls.flax
from optax_dls import writers
from optax_dls._logs.report import inspect

PARAMS = {"w": jnp.ones(3)}
BAD = jnp.float32(-jnp.inf)  # one batch's data term: -inf, and no gradient through it


def loss_fn(params, extra):
  return jnp.sum(params["w"] * 2.0) + extra


def _tx():
  return optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)


def _assert_one_skip(state, params):
  m = optax_dls.metrics(state)
  assert bool(m["skipped"]) and int(m["skip_count"]) == 1
  assert float(m["loss_scale"]) == 2.0**9  # backed off once
  assert bool(m["nonfinite_loss"]) and int(m["nonfinite_step"]) == 1
  np.testing.assert_array_equal(params["w"], PARAMS["w"])


def test_update_with_loss_skips():
  tx = _tx()
  state = tx.init(PARAMS)
  loss, grads = jax.value_and_grad(lambda p: loss_fn(p, BAD) * state.loss_scale)(PARAMS)
  assert np.isfinite(grads["w"]).all()
  updates, state = jax.jit(tx.update)(grads, state, PARAMS, loss=loss)
  _assert_one_skip(state, optax.apply_updates(PARAMS, updates))


@pytest.mark.parametrize("step", ["update", "apply_step"])
def test_value_and_grad_then_update_skips(step):
  tx = _tx()
  grad_fn = optax_dls.value_and_grad(loss_fn, tx)
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, BAD)
  assert np.isneginf(loss) and np.isfinite(grads["w"]).all()
  if step == "update":
    updates, state = jax.jit(tx.update)(grads, state, PARAMS)  # no loss=: the state says it
    params = optax.apply_updates(PARAMS, updates)
  else:
    params, state = jax.jit(apply_step, static_argnums=0)(tx, grads, state, PARAMS)
  _assert_one_skip(state, params)
  # The next step, with a finite loss, is applied: the record does not skip it again.
  (_, grads), state = grad_fn(state, params, jnp.float32(0.0))
  params, state = apply_step(tx, grads, state, params)
  assert bool(state.last_step_finite) and int(state.num_skipped) == 1
  assert not np.array_equal(params["w"], PARAMS["w"])


def test_flax_value_and_grad_then_the_train_state_s_apply_gradients_skips():
  state = TrainState.create(apply_fn=None, params=PARAMS, tx=_tx())
  grad_fn = optax_dls.flax.value_and_grad(loss_fn)
  (loss, grads), state = grad_fn(state, state.params, BAD)
  assert np.isneginf(loss) and np.isfinite(grads["w"]).all()
  state = state.apply_gradients(grads=grads)
  _assert_one_skip(state.opt_state, state.params)
  assert int(state.step) == 1


def test_inspect_counts_the_skip_that_metrics_counts(tmp_path):
  tx = _tx()
  params, state = PARAMS, tx.init(PARAMS)
  grad_fn = optax_dls.value_and_grad(loss_fn, tx)
  with writers.MetricsWriter(tmp_path, tensorboard=False, params=params) as writer:
    for step, extra in enumerate([0.0, -jnp.inf, 0.0], start=1):
      (loss, grads), state = grad_fn(state, params, jnp.float32(extra))
      params, state = apply_step(tx, grads, state, params)
      writer.log(step, optax_dls.metrics(state), loss=loss)
  (report,) = json.loads(inspect(tmp_path, as_json=True)).values()
  summary = report["summary"]
  assert summary["skips"] == int(optax_dls.metrics(state)["skip_count"]) == 1
  assert summary["applied_updates"] == 2 and summary["nonfinite"]["loss_steps"] == [2]
