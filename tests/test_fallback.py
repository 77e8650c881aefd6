"""Float32 fallback: after N consecutive skips the loss runs in float32, then back to float16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

INIT_SCALE = 2.0**10


def _loss(params, x, y, dtype):
  """A linear model whose float16 forward overflows when x is large (x * w > 65504 squared)."""
  pred = x.astype(dtype) @ params["w"].astype(dtype)
  return jnp.mean(jnp.square(pred - y.astype(dtype))).astype(jnp.float32)


def test_training_continues_through_fallback_and_returns_to_fp16(lowering):
  policy = optax_dls.fp32_fallback(
    optax_dls.dynamic_policy(init_scale=INIT_SCALE, growth_interval=1000), after=10, steps=15
  )
  tx = optax_dls.loss_scaled(optax.adam(0.05), policy, skip_lowering=lowering)
  params = {"w": jnp.zeros((4,), jnp.float32)}
  opt_state = tx.init(params)
  traces = []

  def scaled(dtype):
    return lambda p, s, x, y: optax_dls.scale_loss(_loss(p, x, y, dtype), s)

  vg16, vg32 = jax.value_and_grad(scaled(jnp.float16)), jax.value_and_grad(scaled(jnp.float32))
  # The step picks the float32 computation while the fallback is on (docs/observability.md).
  vg = lambda opt_state, *args: jax.lax.cond(
    optax_dls.metrics(opt_state)["fp32_fallback"], vg32, vg16, *args
  )

  @jax.jit
  def step(params, opt_state, x, y):
    traces.append(1)
    _, grads = vg(opt_state, params, opt_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  target = jnp.array([1.0, -2.0, 0.5, 3.0])
  flags, skipped, w_at = [], [], {}
  for i in range(40):
    x = jnp.full((8, 4), 1000.0 if i < 30 else 1.0) * jnp.linspace(0.5, 1.0, 8)[:, None]
    flags.append(bool(optax_dls.metrics(opt_state)["fp32_fallback"]))
    params, opt_state = step(params, opt_state, x, x @ target)
    skipped.append(bool(optax_dls.metrics(opt_state)["skipped"]))
    w_at[i] = np.asarray(params["w"])
    if i == 24:
      scale_after_fallback = float(optax_dls.find_state(opt_state).loss_scale)

  assert flags == [False] * 10 + [True] * 15 + [False] * 15
  assert skipped == [True] * 10 + [False] * 15 + [True] * 5 + [False] * 10
  assert scale_after_fallback == INIT_SCALE
  assert not np.allclose(w_at[9], w_at[24])  # trained in float32
  assert not np.allclose(w_at[29], w_at[39])  # and again in float16
  assert np.isfinite(w_at[39]).all()
  assert len(traces) == 1 and step._cache_size() == 1


def test_fallback_scale_and_flag_end():
  policy = optax_dls.fp32_fallback(
    optax_dls.dynamic_policy(init_scale=64.0), after=2, steps=2, scale=8.0
  )
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  seen = []
  for g in [jnp.inf, jnp.inf, 1.0, 1.0, 1.0]:
    _, state = update({"w": jnp.full(3, g)}, state, params)
    fallback = state.policy_state
    seen.append((bool(fallback.fp32_fallback), int(fallback.steps_left), float(state.loss_scale)))
  assert seen == [
    (False, 0, 32.0),
    (True, 2, 16.0),
    (True, 1, 16.0),
    (False, 0, 8.0),
    (False, 0, 8.0),
  ]


def test_no_fallback_by_default():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**20)
  state = tx.init({"w": jnp.ones(2)})
  for _ in range(12):
    _, state = tx.update({"w": jnp.full(2, jnp.inf)}, state)
  m = optax_dls.metrics(state)
  assert "fp32_fallback" not in m and float(state.loss_scale) == 2.0**8


@pytest.mark.parametrize(
  "kwargs, name",
  [
    ({"after": 0}, "after"),
    ({"steps": 0}, "steps"),
    ({"scale": 0.0}, "scale"),
    ({"scale": 2.0**100}, "scale"),
    ({"scale": 0.5}, "scale"),
  ],
)
def test_bad_fallback_arguments(kwargs, name):
  # The restart scale must lie in the wrapped policy's range, here [1, 2**12].
  with pytest.raises(ValueError, match=name):
    optax_dls.fp32_fallback(
      optax_dls.dynamic_policy(init_scale=2.0**10, max_scale=2.0**12), **kwargs
    )
  with pytest.raises(TypeError, match="policy"):
    optax_dls.fp32_fallback("dynamic")


def test_fallback_state_has_fixed_dtypes_and_counts_skips_at_min_scale():
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(init_scale=2.0), after=2)
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  state = tx.init({"w": jnp.ones(2)})
  update = jax.jit(tx.update)
  counts = []
  for _ in range(4):
    _, new = update({"w": jnp.full(2, jnp.inf)}, state, None)
    assert [x.dtype for x in jax.tree.leaves(new)] == [x.dtype for x in jax.tree.leaves(state)]
    state = new
    m = optax_dls.metrics(state)
    counts.append((int(m["skips_at_min_scale"]), bool(m["fp32_fallback"]), float(m["loss_scale"])))
  # 2 -> 1 (not yet at the minimum), then skips at the minimum 1; the fallback starts at the
  # 2nd skip.
  assert counts == [(0, False, 1.0), (1, True, 1.0), (2, True, 1.0), (3, True, 1.0)]
