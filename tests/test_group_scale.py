"""Per-group gradient scaling: group_scaled, group_unscale (and optax.scale_gradient for one
cotangent, as the docs say)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_dls


def test_optax_scale_gradient_is_identity_forward_and_scales_the_cotangent():
  """The docs point to ``optax.scale_gradient`` for one cotangent: by a power of two it
  keeps each cotangent's dtype and scales it exactly."""
  x = {"a": jnp.asarray([1.0, -2.0], jnp.float16), "b": jnp.asarray(3.0, jnp.float32)}
  assert jax.tree.all(
    jax.tree.map(lambda u, w: bool(jnp.all(u == w)), optax.scale_gradient(x, 8.0), x)
  )
  g = jax.grad(
    lambda t: (
      jnp.sum(optax.scale_gradient(t, 8.0)["a"].astype(jnp.float32) * 3.0)
      + optax.scale_gradient(t, 8.0)["b"]
    )
  )(x)
  assert g["a"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(g["a"], np.float32), [24.0, 24.0])
  assert float(g["b"]) == 8.0


def test_integer_inputs_pass_through():
  f = optax_dls.group_scale.group_scaled(lambda p, x, ids: p * x[ids], 4.0)
  g = jax.grad(lambda p: f(p, jnp.ones([3]), jnp.asarray(1)))(jnp.float32(2.0))
  assert float(g) == 4.0


def _subnet(p, x):
  return jnp.tanh(x @ p["a"]) @ p["b"]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), log_k=st.sampled_from([-8, 0, 5, 16]))
def test_group_gradients_scaled_by_k_and_inputs_unaffected(seed, log_k):
  k = 2.0**log_k
  rng = np.random.default_rng(seed)
  p = {"a": rng.standard_normal([4, 5], np.float32), "b": rng.standard_normal([5, 3], np.float32)}
  x = rng.standard_normal([2, 4], np.float32)
  grads = _grads(p, x, k)
  ref = _grads(p, x, 1.0)
  for name in ("a", "b"):  # powers of two: exact in float32
    np.testing.assert_array_equal(np.asarray(grads[0][name]), np.asarray(ref[0][name]) * k)
  np.testing.assert_array_equal(np.asarray(grads[1]), np.asarray(ref[1]))


def _grads(p, x, k):
  return _compiled(k)(p, x)


_CACHE = {}


def _compiled(k):
  if k not in _CACHE:
    f = optax_dls.group_scale.group_scaled(_subnet, k)
    _CACHE[k] = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(f(p, x))), argnums=(0, 1)))
  return _CACHE[k]


def _adapter_model(k):
  """A frozen fp16 base layer with a large head and a tiny-gradient adapter branch."""
  adapter = (
    optax_dls.group_scale.group_scaled(lambda a, h: (h @ a["down"]) @ a["up"], k)
    if k
    else (lambda a, h: (h @ a["down"]) @ a["up"])
  )

  def loss(params, x):
    h = x.astype(jnp.float16) @ params["base"].astype(jnp.float16)
    a16 = jax.tree.map(lambda t: t.astype(jnp.float16), params["adapter"])
    h = h + adapter(a16, x.astype(jnp.float16)) * jnp.float16(1e-4)
    return jnp.sum((h * jnp.float16(0.125)) ** 2).astype(jnp.float32)

  return loss


def _params():
  key1, key2, key3 = jax.random.split(jax.random.key(0), 3)
  return {
    "base": jax.random.normal(key1, [8, 8]) * 0.1,
    "adapter": {
      "down": jax.random.normal(key2, [8, 2]) * 3e-3,
      "up": jax.random.normal(key3, [2, 8]) * 3e-3,
    },
  }


def test_group_scaling_rescues_underflowing_adapter_gradients():
  params = _params()
  x = jax.random.normal(jax.random.key(1), [4, 8])
  scale = 1.0  # the largest scale the rest of the network allows, say
  exact = jax.jit(jax.grad(lambda p: _adapter_model_f32(p, x)))(params)["adapter"]
  plain = jax.jit(jax.grad(lambda p: _adapter_model(None)(p, x) * scale))(params)["adapter"]
  k = 2.0**12
  grouped = jax.jit(jax.grad(lambda p: _adapter_model(k)(p, x) * scale))(params)["adapter"]
  zeros_plain = np.mean([np.mean(np.asarray(g) == 0) for g in jax.tree.leaves(plain)])
  zeros_grouped = np.mean([np.mean(np.asarray(g) == 0) for g in jax.tree.leaves(grouped)])
  assert zeros_plain > 0.5 and zeros_grouped == 0.0
  for name in ("down", "up"):
    _close(np.asarray(grouped[name]) / (scale * k), np.asarray(exact[name]))


def _close(got, want):
  """Equal up to float16 rounding, relative to the largest entry."""
  np.testing.assert_allclose(got, want, atol=3e-2 * np.max(np.abs(want)), rtol=0)


def _adapter_model_f32(params, x):
  h = x @ params["base"] + (x @ params["adapter"]["down"]) @ params["adapter"]["up"] * 1e-4
  return jnp.sum((h * 0.125) ** 2)


def _adapter_tx(k, inner=None):
  mask = {"base": False, "adapter": {"down": True, "up": True}}
  inner = inner or optax.sgd(1.0)
  return optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.group_scale.group_unscale(k, mask), inner), init_scale=2.0**4
  )


def test_group_unscale_inside_the_wrapper_recovers_true_gradients():
  params, k = _params(), 2.0**12
  x = jax.random.normal(jax.random.key(1), [4, 8])
  tx = _adapter_tx(k)
  state = tx.init(params)
  grads = jax.jit(jax.grad(lambda p: optax_dls.scale_loss(_adapter_model(k)(p, x), state)))(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  exact = jax.jit(jax.grad(lambda p: _adapter_model_f32(p, x)))(params)
  assert bool(optax_dls.metrics(state)["skipped"]) is False
  for name in ("down", "up"):
    _close(-np.asarray(updates["adapter"][name]), np.asarray(exact["adapter"][name]))
  _close(-np.asarray(updates["base"]), np.asarray(exact["base"]))


def test_overflow_inside_the_group_skips_the_step():
  params, k = _params(), 2.0**40  # so large that the adapter's fp16 cotangents overflow
  x = jax.random.normal(jax.random.key(1), [4, 8])
  tx = _adapter_tx(k, optax.adam(1e-3))
  state = tx.init(params)
  grads = jax.jit(jax.grad(lambda p: optax_dls.scale_loss(_adapter_model(k)(p, x), state)))(params)
  updates, new = jax.jit(tx.update)(grads, state, params)
  assert bool(optax_dls.metrics(new)["skipped"]) is True
  assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
  assert float(optax_dls.find_state(new).loss_scale) == 2.0**3


@pytest.mark.parametrize("factor", [0.0, -2.0, float("inf"), 2.0**127])
def test_bad_factor_raises_value_error_naming_it(factor):
  with pytest.raises(ValueError, match="factor"):
    optax_dls.group_scale.group_scaled(_subnet, factor)
  with pytest.raises(ValueError, match="factor"):
    optax_dls.group_scale.group_unscale(factor, {"w": True})


def test_traced_factor_raises_type_error():
  with pytest.raises(TypeError, match="factor"):
    jax.jit(lambda k: optax_dls.group_scale.group_scaled(_subnet, k))(2.0)


@pytest.mark.parametrize("fn", [None, 2.0, "subnet"])
def test_group_scaled_needs_a_callable(fn):
  with pytest.raises(TypeError, match="fn must be callable"):
    optax_dls.group_scale.group_scaled(fn, 2.0)


@pytest.mark.parametrize(
  "mask", ["abc", None, {"w": "yes"}, {"w": 1}, {"w": jnp.ones(2, bool)}, [True, 0.5]]
)
def test_group_unscale_mask_must_be_bools_or_a_callable(mask):
  with pytest.raises(TypeError, match="mask"):
    optax_dls.group_scale.group_unscale(2.0, mask)


@pytest.mark.parametrize(
  "mask",
  [
    {"w": True, "b": False},
    {"w": np.bool_(True), "b": jnp.asarray(False)},
    True,
    lambda params: {"w": True, "b": False},
  ],
)
def test_group_unscale_accepts_bools_and_callables(mask):
  tx = optax_dls.group_scale.group_unscale(4.0, mask)
  params = {"w": jnp.ones(2), "b": jnp.ones(1)}
  updates, _ = tx.update({"w": jnp.full(2, 8.0), "b": jnp.full(1, 8.0)}, tx.init(params), params)
  assert float(updates["w"][0]) == 2.0
  assert float(updates["b"][0]) == (2.0 if mask is True else 8.0)


def test_group_scaled_keeps_the_calling_convention_of_fn():
  """Python flags, strings, keywords and non-floating outputs pass through; under jit the
  flags can be static arguments; the gradients are those of the plain call, scaled."""

  def fn(params, x, mode, *, train=True, labels=None):
    y = params["w"] * x
    return (y if train else -y), {"mode": mode, "n": jnp.arange(2), "labels": labels}

  wrapped = optax_dls.group_scale.group_scaled(fn, 4.0)
  params, x = {"w": jnp.float32(2.0)}, jnp.float32(3.0)
  out, aux = wrapped(params, x, "eval", train=False, labels=None)
  assert float(out) == -6.0 and aux["mode"] == "eval" and aux["labels"] is None
  np.testing.assert_array_equal(aux["n"], np.arange(2))

  def loss(p, x):
    return wrapped(p, x, "train", train=True)[0]

  grads = jax.grad(loss, argnums=(0, 1))(params, x)
  assert float(grads[0]["w"]) == 4.0 * 3.0 and float(grads[1]) == 2.0  # x's is not scaled
  jitted = jax.jit(
    lambda p, x, mode, train: wrapped(p, x, mode, train=train)[0], static_argnums=(2, 3)
  )
  assert float(jitted(params, x, "eval", False)) == -6.0


@pytest.mark.parametrize("callable_mask", [False, True])
def test_group_unscale_refuses_a_mask_of_another_tree_naming_both(callable_mask):
  params = {"w": jnp.ones(2), "b": jnp.ones(1)}
  wrong = {"w": True, "c": False}
  mask = (lambda p: wrong) if callable_mask else wrong
  tx = optax_dls.group_scale.group_unscale(4.0, mask)
  match = r"group_unscale: mask must have the tree structure of the parameters.*'c'.*'b'"
  with pytest.raises(ValueError, match=match):
    tx.init(params)
  # At the first update's trace, before anything is compiled: our message, not JAX's.
  state = optax_dls.group_scale.group_unscale(4.0, {"w": True, "b": False}).init(params)
  step = jax.jit(lambda g, s: tx.update(g, s, params))
  with pytest.raises(ValueError, match=r"mask must have the tree structure of the gradients"):
    step({"w": jnp.ones(2), "b": jnp.ones(1)}, state)
