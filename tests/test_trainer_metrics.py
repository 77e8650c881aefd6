"""What a trainer logs: the scalar view of metrics summed over steps, the learning rate at
the applied steps, and the unscaled gradient norm (observability.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0])}


def _run(tx, xs):
  state, params, summed, seen = tx.init(PARAMS), PARAMS, None, []

  @jax.jit
  def step(p, s, x):
    g = jax.grad(lambda p: optax_dls.scale_loss(jnp.sum(p["w"] * x), s))(p)
    scaled_norm, scale = optax.tree_utils.tree_norm(g), optax_dls.find_state(s).loss_scale
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, scaled_norm / scale, u

  for x in xs:
    params, state, norm, updates = step(params, state, x)
    m = optax_dls.metrics(state, scalars_only=True)
    summed = m if summed is None else jax.tree.map(jnp.add, summed, m)
    seen.append((float(norm), float(optax_dls.metrics(state)["grad_norm"]), updates, x))
  return state, summed, seen


def test_the_scalar_view_sums_over_steps_and_the_lr_follows_the_applied_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  tx = optax_dls.dynamic_loss_scale(optax.sgd(schedule))
  inf = jnp.full(3, jnp.inf)
  state, summed, seen = _run(tx, [jnp.ones(3), inf, jnp.ones(3), inf, jnp.ones(3)])
  full = optax_dls.metrics(state)
  assert set(full) - set(summed) == {"nonfinite_leaves", "nonfinite_nan"}
  assert all(v.shape == () for v in summed.values())
  assert summed["skipped"].dtype == jnp.int32 and int(summed["skipped"]) == 2  # counted
  applied = int(full["num_steps"] - full["skip_count"])
  assert applied == 3  # not the 5 calls
  norm, measured, updates, x = seen[-1]
  lr = -float(updates["w"][0]) / float(x[0])  # sgd: the update is -lr * g, g = x
  np.testing.assert_allclose(lr, schedule(applied - 1), rtol=1e-6)  # the last applied step's
  for norm, measured, _, _ in (seen[0], seen[2], seen[4]):
    np.testing.assert_allclose(norm, measured, rtol=1e-6)
    np.testing.assert_allclose(measured, np.sqrt(3.0), rtol=1e-6)


def test_with_multisteps_the_gradient_step_counts_the_applied_micro_steps_over_k():
  tx = optax_dls.dynamic_loss_scale(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  xs = [jnp.ones(3), jnp.full(3, jnp.inf)] + [jnp.ones(3)] * 4
  state, _, _ = _run(tx, xs)
  m = optax_dls.metrics(state)
  inner = optax_dls.find_state(state).inner_state
  assert int(inner.gradient_step) == int(m["num_steps"] - m["skip_count"]) // 2 == 2


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_scalars_only_must_be_a_bool(bad):
  with pytest.raises(TypeError, match="scalars_only must be"):
    optax_dls.metrics(optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS), scalars_only=bad)
