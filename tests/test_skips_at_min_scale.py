"""fp32_fallback's count of consecutive skips at the policy's floor (``skips_at_min_scale``
in metrics)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dls

P = {"w": jnp.zeros(2)}


def _counts(policy, kinds, lowering="auto"):
  tx = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.fp32_fallback(policy, after=100), skip_lowering=lowering
  )
  update, state, out = jax.jit(tx.update), tx.init(P), []
  for k in kinds:
    _, state = update({"w": jnp.full(2, k)}, state, P)
    m = optax_dls.metrics(state)
    out.append((int(m["skips_at_min_scale"]), float(m["loss_scale"])))
  return out


def test_counts_only_skips_taken_at_the_floor_and_resets_on_a_clean_step(lowering):
  inf = float("inf")
  out = _counts(
    optax_dls.dynamic_policy(init_scale=4.0, min_scale=1.0),
    [inf, inf, inf, inf, 1.0, inf],
    lowering,
  )
  # 4 -> 2 -> 1 (backoffs), then two skips at the floor; a clean step resets; one more at the floor.
  assert out == [(0, 2.0), (0, 1.0), (1, 1.0), (2, 1.0), (0, 1.0), (1, 1.0)]


def test_a_static_scale_is_its_own_floor():
  assert _counts(optax_dls._policies.static_policy(8.0), [float("nan")] * 3) == [
    (1, 8.0),
    (2, 8.0),
    (3, 8.0),
  ]


def test_the_scale_is_the_wrapped_policy_s():
  kinds = [1.0, float("inf"), 1.0, 1.0, 1.0]
  policy = optax_dls.dynamic_policy(init_scale=4.0, growth_interval=2)
  plain = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  state, scales = plain.init(P), []
  for k in kinds:
    _, state = plain.update({"w": jnp.full(2, k)}, state, P)
    scales.append(float(state.loss_scale))
  assert [s for _, s in _counts(policy, kinds)] == scales


def test_rejects_a_non_policy():
  with pytest.raises(TypeError, match="policy"):
    optax_dls.fp32_fallback(optax.sgd(0.1))


def test_the_count_restarts_when_the_fallback_ends():
  """The fallback's end restarts the wrapped policy's state, the count with it."""
  policy = optax_dls.fp32_fallback(optax_dls._policies.static_policy(8.0), after=2, steps=2)
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  state, seen = tx.init(P), []
  for _ in range(4):
    _, state = tx.update({"w": jnp.full(2, jnp.inf)}, state, P)
    m = optax_dls.metrics(state)
    seen.append((int(m["skips_at_min_scale"]), bool(m["fp32_fallback"])))
  assert seen == [(1, False), (2, True), (3, True), (0, False)]
