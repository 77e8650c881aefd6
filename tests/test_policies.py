"""Loss-scale policies: the built-in ones, user-written ones, and the checks of a policy."""

from __future__ import annotations

import functools
import pathlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import optax_dls
from optax_dls import _policies
from optax_dls._policies.base import GradStats

F16_MAX = 65504.0
LENGTH = 32
CONFIG = dict(
  init_scale=2.0**15, margin=1.0, history_len=4, growth_interval=3, min_scale=1.0, max_scale=2.0**24
)


@functools.cache
def _run(config: tuple):
  """Jitted scan of the policy over (finite, unscaled amax) pairs; returns scales and peaks."""
  policy = optax_dls.amax_policy(**dict(config))

  def step(carry, xs):
    scale, state = carry
    finite, amax = xs
    stats = GradStats(
      finite=finite, step=jnp.zeros([], jnp.int32), grad_norm=amax, amax=amax * scale
    )
    new_scale, state = policy.update(scale, state, stats)
    return (new_scale, state), (new_scale, jnp.max(state.amax_history), state.growth_tracker)

  return jax.jit(lambda finite, amax: lax.scan(step, policy.init(), (finite, amax))[1])


steps = st.lists(
  st.tuples(
    st.sampled_from([True, True, True, False]), st.floats(-30, 4).map(lambda e: 2.0**e * 1.37)
  ),
  min_size=LENGTH,
  max_size=LENGTH,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(seq=steps)
def test_scale_keeps_recent_amax_below_the_margin(seq):
  finite = np.array([f for f, _ in seq], bool)
  finite[0] = True
  amax = np.array([a for _, a in seq], np.float32)
  scales, peaks, _trackers = (
    np.asarray(x, np.float64)
    for x in _run(tuple(sorted(CONFIG.items())))(jnp.asarray(finite), jnp.asarray(amax))
  )
  prev = np.concatenate([[CONFIG["init_scale"]], scales[:-1]])
  headroom = F16_MAX / 2.0 ** CONFIG["margin"]
  assert np.all((scales >= CONFIG["min_scale"]) & (scales <= CONFIG["max_scale"]))
  assert np.all(np.log2(scales) == np.round(np.log2(scales)))  # powers of two
  for t in range(LENGTH):
    if not finite[t]:  # non-finite: the dynamic backoff
      assert scales[t] == max(prev[t] / 2, CONFIG["min_scale"])
      continue
    # Every recent magnitude, scaled by the new S, stays below max / 2**margin.
    assert scales[t] == CONFIG["min_scale"] or scales[t] * peaks[t] <= headroom * (1 + 2**-20)
    assert scales[t] <= 2 * prev[t]  # at most one growth factor per step
    if scales[t] > prev[t]:  # growth only after growth_interval clean steps
      assert np.all(finite[max(0, t - CONFIG["growth_interval"] + 1) : t + 1])
    if scales[t] < prev[t]:  # a backoff goes to the largest safe power of two
      assert 2 * scales[t] * peaks[t] > headroom * (1 - 2**-20)


def test_grows_every_growth_interval_when_far_below():
  n = 12
  scales, _, _ = _run(tuple(sorted(CONFIG.items())))(jnp.ones([n], bool), jnp.full([n], 2.0**-40))
  expected = [2.0**15 * 2 ** ((t + 1) // 3) for t in range(n)]
  assert np.asarray(scales).tolist() == expected


def test_overflow_holds_the_scale_down_for_the_history():
  # One overflow at S=2**15, then tiny gradients: the recorded 65504/S keeps the
  # scale at or below S/2 until it leaves the 4-step history.
  finite = jnp.asarray([False] + [True] * 9)
  scales, _, _ = _run(tuple(sorted(CONFIG.items())))(finite, jnp.full([10], 2.0**-40))
  scales = np.asarray(scales)
  assert scales[0] == 2.0**14
  assert np.all(scales[1:4] == 2.0**14)
  assert scales[4:].max() > 2.0**14


def _drifting_run(policy, n=200):
  """fp16 gradients whose magnitude drifts up and down (period 50); returns skips and scales."""
  tx = optax_dls.loss_scaled(optax.sgd(0.0), policy)
  params = {"w": jnp.zeros([64], jnp.float32)}
  base = jnp.linspace(0.1, 1.0, 64)

  def step(state, t):
    magnitude = 2.0 ** (4.0 * jnp.sin(t * 2 * jnp.pi / 50.0))
    scaled = (base * magnitude * optax_dls.find_state(state).loss_scale).astype(
      jnp.float16
    )  # fp16 compute
    _, state = tx.update({"w": scaled.astype(jnp.float32)}, state, params)
    return state, optax_dls.find_state(state).loss_scale

  state, scales = jax.jit(lambda s: lax.scan(step, s, jnp.arange(n, dtype=jnp.float32)))(
    tx.init(params)
  )
  return int(optax_dls.metrics(state)["skip_count"]), np.asarray(scales)


def test_skips_fewer_steps_than_the_dynamic_policy_on_drifting_gradients():
  dyn_skips, _ = _drifting_run(optax_dls.dynamic_policy(init_scale=2.0**15, growth_interval=20))
  amax_skips, scales = _drifting_run(optax_dls.amax_policy(init_scale=2.0**15))
  assert dyn_skips >= 5
  assert amax_skips == 0
  assert scales.min() < scales.max()  # it moved both ways, without overflowing


def test_amax_is_measured_on_the_scaled_fp16_gradients_inside_the_wrapper():
  tx = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.amax_policy(init_scale=2.0**8, history_len=2)
  )
  params = {"w": jnp.asarray([1.0, -3.0, 0.5], jnp.float32)}
  state = tx.init(params)

  def loss(p):
    x = jnp.asarray([2.0, 1.0, -4.0], jnp.float16)
    return optax_dls.scale_loss(jnp.sum(p["w"].astype(jnp.float16) * x).astype(jnp.float32), state)

  grads = jax.grad(loss)(params)
  _, new = jax.jit(tx.update)(grads, state, params)
  history = new.policy_state.amax_history
  assert float(history[0]) == 4.0  # max |x| = max |dloss/dw|, unscaled by S = 2**8
  assert float(jnp.max(jnp.abs(grads["w"]))) == 4.0 * 2**8


def test_grad_norm_statistic_needs_no_amax():
  policy = optax_dls.amax_policy(statistic="grad_norm", init_scale=2.0**10)
  assert policy.stats == ()
  scale, state = policy.init()
  stats = GradStats(jnp.bool_(True), jnp.int32(0), jnp.float32(100.0), None)
  new_scale, _ = jax.jit(policy.update)(scale, state, stats)
  assert float(new_scale) == 128.0  # largest 2**k with 100 * 2**k <= 65504 / 2**2 (margin 2)


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(margin=-1.0), "margin"),
    (dict(history_len=0), "history_len"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(max_value=float("inf")), "max_value"),
    (dict(init_scale=0.5), "init_scale"),
    (dict(min_scale=4.0, max_scale=2.0), "max_scale"),
    (dict(statistic="rms"), "statistic"),
  ],
)
def test_bad_hyperparameters_raise_value_error_naming_them(kwargs, name):
  with pytest.raises(ValueError, match=name) as err:
    optax_dls.amax_policy(**kwargs)
  assert repr(list(kwargs.values())[-1]) in str(err.value)


def test_traced_hyperparameter_raises_type_error():
  with pytest.raises(TypeError, match="margin"):
    jax.jit(lambda m: optax_dls.amax_policy(margin=m))(1.0)
  with pytest.raises(TypeError, match="history_len"):
    optax_dls.amax_policy(history_len=4.0)


def test_state_has_fixed_dtypes_and_survives_jit_and_flattening():
  tx = optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.amax_policy(history_len=5))
  params = {"w": jnp.ones([3])}
  state = tx.init(params)
  state = jax.jit(tx.update)({"w": jnp.full([3], 2.0**10)}, state, params)[1]
  policy_state = optax_dls.find_state(state).policy_state
  assert isinstance(policy_state, _policies.AmaxScaleState)
  assert policy_state.amax_history.dtype == jnp.float32 and policy_state.amax_history.shape == (5,)
  assert policy_state.growth_tracker.dtype == jnp.int32 and policy_state.growth_tracker.shape == ()
  leaves, treedef = jax.tree.flatten(state)
  again = jax.jit(lambda s: s)(jax.tree.unflatten(treedef, leaves))
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "kw", [{"max_value": 1e39}, {"max_value": 1e-46}, {"max_value": 1e-30, "margin": 64}]
)
def test_amax_max_value_must_be_a_normal_float32(kw):
  with pytest.raises(ValueError, match="max_value"):
    optax_dls.amax_policy(**kw)


def test_statistic_of_wrong_type_raises_type_error():
  with pytest.raises(TypeError, match="statistic"):
    optax_dls.amax_policy(statistic=None)
  with pytest.raises(TypeError, match="statistic"):
    optax_dls.amax_policy(statistic=["amax"])


class MyState(NamedTuple):
  clean: jax.Array  # int32: finite steps since the last change
  seen: jax.Array  # float32 (3,): (step, grad_norm, amax) of the last GradStats


def my_policy(init_scale=2.0**10, every=2, amax_limit=2.0**14):
  """Double every `every` clean steps, halve on overflow or when a scaled gradient nears the
  limit."""

  def init():
    return jnp.float32(init_scale), MyState(jnp.zeros([], jnp.int32), jnp.zeros(3, jnp.float32))

  def update(scale, state, stats):
    clean = jnp.where(stats.finite, state.clean + 1, 0)
    grow = clean >= every
    shrink = ~stats.finite | (stats.amax > amax_limit)
    scale = jnp.where(shrink, scale / 2, jnp.where(grow, scale * 2, scale))
    seen = jnp.stack([stats.step.astype(jnp.float32), stats.grad_norm, stats.amax])
    return scale.astype(jnp.float32), MyState(
      jnp.where(grow | shrink, 0, clean).astype(jnp.int32), seen
    )

  return optax_dls.LossScalePolicy(init, update, stats=("amax",))


def test_custom_policy_through_loss_scaled():
  params = {"w": jnp.zeros(2, jnp.float32)}
  tx = optax_dls.loss_scaled(optax.adam(1e-2), my_policy())

  @jax.jit
  def step(params, state, g):
    g = {"w": g * optax_dls.find_state(state).loss_scale}
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  state, scales, inner = tx.init(params), [], []
  # unscaled gradients: two clean, one overflow, one clean, then one whose scaled amax
  # (20 * 2**10 = 20480) passes the limit, then a clean one.
  for g in ([1.0, 2.0], [3.0, 4.0], [np.inf, 1.0], [1.0, 1.0], [20.0, 1.0], [1.0, 1.0]):
    before = state.inner_state
    params, state = step(params, state, jnp.array(g, jnp.float32))
    scales.append(float(optax_dls.find_state(state).loss_scale))
    inner.append(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state.inner_state, before))
  assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**9, 2.0**9]
  assert all(jax.tree.leaves(inner[2])) and not all(jax.tree.leaves(inner[3]))  # skip left it
  step_seen, norm_seen, amax_seen = np.asarray(state.policy_state.seen)
  assert step_seen == 5 and norm_seen == np.float32(np.sqrt(2.0)) and amax_seen == 2.0**9
  m = optax_dls.metrics(state)
  assert int(m["skip_count"]) == 1 and bool(jnp.all(jnp.isfinite(params["w"])))


DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def _load_policy():
  text = DOC.read_text()
  match = re.search(r"<!-- test: user-policy -->\s*```python\n(.*?)```", text, re.DOTALL)
  assert match, "docs/policies.md lost its user-policy code block"
  code = match.group(1)
  assert 10 <= len(code.strip().splitlines()) <= 30
  namespace = {}
  exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
  return namespace["norm_target_policy"]


def test_documented_policy_runs_inside_loss_scaled():
  policy = _load_policy()(init_scale=2.0**10, target=2.0**12)
  assert isinstance(policy, optax_dls.LossScalePolicy)
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  params = {"w": jnp.zeros([4], jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  true_grad = jnp.asarray([0.5, -0.5, 0.5, -0.5])  # global norm 1
  scales, updates_seen = [], []
  for value in (1.0, 1.0, 1.0, jnp.inf, 1.0):
    grads = {"w": true_grad * value * optax_dls.find_state(state).loss_scale}
    updates, state = update(grads, state, params)
    scales.append(float(optax_dls.find_state(state).loss_scale))
    updates_seen.append(np.asarray(updates["w"]))
  # Towards S * norm = 2**12 from 2**10, one octave a step; then held; halved on inf.
  assert scales == [2.0**11, 2.0**12, 2.0**12, 2.0**11, 2.0**12]
  np.testing.assert_array_equal(updates_seen[0], -0.1 * np.asarray(true_grad))  # unscaled exactly
  assert not np.any(updates_seen[3])  # the non-finite step was skipped
  assert int(optax_dls.find_state(state).policy_state) == 1  # one backoff counted
  assert int(optax_dls.metrics(state)["skip_count"]) == 1
