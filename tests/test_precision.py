"""select_precision: the float16 or the float32 computation, chosen inside the step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls


def _fallback_state(on):
  """A state whose fp32_fallback policy wrapper is on (after one skip) or off."""
  tx = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=1, steps=3)
  )
  state = tx.init({"w": jnp.ones(2)})
  if on:
    _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state)
  return state


def test_select_precision_promotes_and_checks_structure():
  tx = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.fp32_fallback(optax_dls.dynamic_policy(), after=1, steps=3)
  )
  state = tx.init({"w": jnp.ones(2)})
  f16 = lambda x: (x * 2).astype(jnp.float16)
  f32 = lambda x: x * 3
  out = optax_dls.select_precision(state, f16, f32, jnp.ones(2))
  assert out.dtype == jnp.float32 and np.allclose(out, 2.0)
  _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state)
  assert np.allclose(optax_dls.select_precision(state, f16, f32, jnp.ones(2)), 3.0)
  with pytest.raises(ValueError, match="structure"):
    optax_dls.select_precision(state, lambda x: (x, x), f32, jnp.ones(2))


def test_both_functions_must_be_callable():
  state = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.fp32_fallback(optax_dls.dynamic_policy())
  ).init({"w": jnp.ones(2)})
  with pytest.raises(TypeError, match="fp16_fn"):
    optax_dls.select_precision(state, None, lambda x: x, jnp.ones(2))
  with pytest.raises(TypeError, match="fp32_fn"):
    optax_dls.select_precision(state, lambda x: x, 3.0, jnp.ones(2))


def test_select_precision_without_the_fallback_runs_fp16():
  state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
  out = optax_dls.select_precision(
    state, lambda x: x.astype(jnp.float16), lambda x: x * 3, jnp.ones(2)
  )
  assert out.dtype == jnp.float32 and np.allclose(out, 1.0)


@pytest.mark.parametrize("on", [False, True])
def test_python_arguments_reach_the_function_as_they_are_under_every_policy(on):
  seen = []

  def fn(factor):
    def run(x, double, name, *, mode, table):
      seen.append((type(double), name, mode, table["k"]))
      return x * factor * (2 if double else 1) * (3 if mode == "triple" else 1)

    return run

  plain = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
  for state in (_fallback_state(on), plain):
    seen.clear()
    out = optax_dls.select_precision(
      state, fn(1.0), fn(10.0), jnp.ones(2), True, "w", mode="triple", table={"k": "v"}
    )
    np.testing.assert_allclose(out, 60.0 if on and state is not plain else 6.0)
    assert all(s == (bool, "w", "triple", "v") for s in seen) and seen


def test_python_arguments_under_jit():
  state = _fallback_state(True)
  f16 = lambda x, double: (x * (2 if double else 1)).astype(jnp.float16)
  f32 = lambda x, double: x * (4 if double else 1)
  step = jax.jit(lambda s, x: optax_dls.select_precision(s, f16, f32, x, True))
  np.testing.assert_allclose(step(state, jnp.ones(2)), 4.0)
  np.testing.assert_allclose(step(_fallback_state(False), jnp.ones(2)), 2.0)
