"""Gradient accumulation: dynamic_loss_scale(optax.MultiSteps(inner, k)).

A non-finite micro-batch is dropped before it reaches the accumulator and the
scale backs off; every micro-batch is unscaled with the scale its loss was
multiplied by; the inner optimizer advances once per emitted window.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

NAN = float("nan")


def _loss(w, x, state):
  return optax_dls.scale_loss(jnp.sum(w * x), state)  # d/dw = S * x


@functools.partial(jax.jit, static_argnums=3)
def _micro_step(w, x, state, tx):
  grads = jax.grad(_loss)(w, x, state)
  updates, state = tx.update(grads, state, w)
  return w + updates, updates, state


def _run(tx, xs, w=None):
  """Feeds micro-batches with gradient x_i (scaled by the current S); returns the history."""
  w = jnp.zeros(3, jnp.float32) if w is None else w
  state = tx.init(w)
  hist = []
  for x in xs:
    scale = float(optax_dls.find_state(state).loss_scale)
    w, updates, state = _micro_step(w, jnp.full(3, x, jnp.float32), state, tx)
    hist.append((scale, np.asarray(updates), state))
  return w, hist


def _multisteps_state(state):
  return optax_dls.find_state(state).inner_state


def test_nan_micro_batch_is_dropped_and_adam_advances_once_per_window(lowering):
  # Failure kind 4 of docs/design.md: k=4, micro-batch gradients [NaN, 1, 1, 1, 1, ...].
  k, s0 = 4, 2.0**12
  tx = optax_dls.dynamic_loss_scale(
    optax.MultiSteps(optax.adam(0.1), k), init_scale=s0, skip_lowering=lowering
  )
  _, hist = _run(tx, [NAN] + [1.0] * (2 * k))
  updates = np.stack([u for _, u, _ in hist])
  assert np.isfinite(updates).all()
  emitted = [i for i, u in enumerate(updates) if np.any(u != 0)]
  assert emitted == [k, 2 * k]  # the NaN micro-batch did not count towards the window
  assert [s for s, _, _ in hist][:2] == [s0, s0 / 2]  # backed off right after it
  final = hist[-1][2]
  ms = _multisteps_state(final)
  assert int(ms.gradient_step) == 2
  assert int(ms.inner_opt_state[0].count) == 2  # adam: once per applied window
  assert np.isfinite(np.asarray(ms.acc_grads)).all()
  m = optax_dls.metrics(final)
  assert int(m["skip_count"]) == 1 and int(m["num_steps"] - m["skip_count"]) == 2 * k
  # The emitted update is adam's on the mean unscaled gradient (all ones), compiled as the
  # step is (evaluated op by op, adam can round differently in the last place).
  ref = optax.adam(0.1)
  ref_updates, _ = jax.jit(ref.update)(jnp.ones(3), ref.init(jnp.zeros(3)), jnp.zeros(3))
  np.testing.assert_array_equal(updates[k], ref_updates)


def test_scale_changes_inside_a_window_are_unscaled_exactly(lowering):
  # Growth on every clean micro-batch and a back-off in the middle of the window:
  # each micro-batch arrives with a different S, the window mean must be exact.
  tx = optax_dls.dynamic_loss_scale(
    optax.MultiSteps(optax.sgd(1.0), 4),
    init_scale=2.0**8,
    growth_interval=1,
    skip_lowering=lowering,
  )
  w, hist = _run(tx, [1.0, 2.0, NAN, 3.0, 4.0])
  scales = [s for s, _, _ in hist]
  assert scales == [2.0**8, 2.0**9, 2.0**10, 2.0**9, 2.0**10]
  assert all(not np.any(u) for _, u, _ in hist[:4])
  np.testing.assert_array_equal(hist[4][1], np.full(3, -2.5, np.float32))
  np.testing.assert_array_equal(w, np.full(3, -2.5, np.float32))


def test_multisteps_outside_is_refused_with_a_clear_error(lowering):
  tx = optax.MultiSteps(optax_dls.dynamic_loss_scale(optax.adam(0.1), skip_lowering=lowering), 4)
  state = tx.init(jnp.zeros(3))
  for fn in (optax_dls.metrics, optax_dls.find_state):
    with pytest.raises(ValueError, match=r"dynamic_loss_scale\(optax.MultiSteps"):
      fn(state)
  with pytest.raises(ValueError, match="not supported"):
    optax_dls.scale_loss(jnp.float32(1.0), state)


def test_why_multisteps_outside_is_refused():
  # optax.MultiSteps resets its accumulator as (1 - emit) * acc, and 0 * NaN = NaN:
  # one NaN micro-batch keeps every later window non-finite, so the loss scaler inside
  # would skip forever. If optax changes this, this order could be reconsidered.
  tx = optax.MultiSteps(optax.sgd(1.0), 2)
  w = jnp.zeros(3)
  state = tx.init(w)
  update = jax.jit(tx.update)
  for g in [NAN, 1.0, 1.0, 1.0, 1.0, 1.0]:
    _, state = update(jnp.full(3, g), state, w)
  assert not np.isfinite(np.asarray(state.acc_grads)).all()


def test_multisteps_object_and_gradient_transformation_are_equivalent(lowering):
  xs = [1.0, NAN, 2.0, 3.0, 5.0]
  a = optax_dls.dynamic_loss_scale(
    optax.MultiSteps(optax.adam(0.1), 2), init_scale=4.0, skip_lowering=lowering
  )
  b = optax_dls.dynamic_loss_scale(
    optax.MultiSteps(optax.adam(0.1), 2).gradient_transformation(),
    init_scale=4.0,
    skip_lowering=lowering,
  )
  wa, _ = _run(a, xs)
  wb, _ = _run(b, xs)
  np.testing.assert_array_equal(wa, wb)
  assert np.any(wa != 0)


def test_value_and_grad_refuses_multisteps_outside_by_name():
  # The refused order gets the ValueError every reader of the state gives, naming the
  # supported order, not a TypeError calling MultiSteps no transformation.
  tx = optax.MultiSteps(optax_dls.dynamic_loss_scale(optax.adam(1e-3)), every_k_schedule=2)
  with pytest.raises(ValueError, match=r"MultiSteps.*dynamic_loss_scale\(optax\.MultiSteps"):
    optax_dls.value_and_grad(lambda p: jnp.sum(p["w"]), tx)
