"""apply_step equals update + apply_updates (up to the rounding of fused arithmetic),
and keeps params bit for bit on a skip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {"w": jnp.array([1.0, -0.0, 3.0]), "b": jnp.array([0.5], jnp.float16)}


def _grads(v):
  return {"w": jnp.array([v, 2.0, -1.0]), "b": jnp.array([v], jnp.float16)}


@pytest.mark.parametrize("make, values", [
    (lambda: optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=8.0, growth_interval=2),
     [1.0, float("inf"), 0.25, float("nan"), 2.0]),
    (lambda: optax_dls.no_loss_scale(optax.adam(1e-2)), [1.0, 0.25, 2.0]),
    (lambda: optax.adam(1e-2), [1.0, 0.25, 2.0]),  # not loss-scaled: the two-call fallback
], ids=["dynamic", "noop", "plain"])
def test_same_params_and_state_as_update_then_apply(make, values):
  tx = make()
  fused = jax.jit(lambda g, s, p: optax_dls.apply_step(tx, g, s, p))

  @jax.jit
  def two_calls(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  a = b = PARAMS
  sa = sb = tx.init(PARAMS)
  for v in values:
    a, sa = fused(_grads(v), sa, a)
    b, sb = two_calls(_grads(v), sb, b)
    # XLA may fuse (and so round) the applied update differently: equal to float32 rounding.
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
      np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-6, atol=1e-9)


def test_skip_returns_params_bit_for_bit():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0)
  state = tx.init(PARAMS)
  new, state = jax.jit(lambda g, s, p: optax_dls.apply_step(tx, g, s, p))(_grads(float("inf")), state, PARAMS)
  assert not bool(state.last_step_finite)
  assert np.signbit(np.asarray(new["w"])[1])  # -0.0 stays -0.0 (p + 0 would give +0.0)
  for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(PARAMS)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rejects_non_transformation():
  with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
    optax_dls.apply_step(lambda g: g, {}, None, {})
