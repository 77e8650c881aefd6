"""Scale trajectories against loss scalers we did not write: PyTorch GradScaler and jmp.

Random sequences of finite / inf / -inf / NaN steps must give the same loss
scale after every step, under matching settings. Known differences by design
(see docs/design.md): torch has no floor (its scale can reach 0) and refuses
growth only at inf; jmp refuses growth only at inf; we clamp to
``[min_scale, max_scale]``. The random tests keep both bounds out of reach and
separate tests pin our floor and ceiling against the oracle clamped by hand.
Growth timing is the same in all three (on the growth_interval-th consecutive
clean step); flax's DynamicScale, not used here, grows one step later.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optax_dls

try:
  import torch
except ImportError:
  torch = None
try:
  import jmp
except ImportError:
  jmp = None

# Each oracle skips on its own, with the reason shown, when its package is absent.
needs_torch = pytest.mark.skipif(
  torch is None, reason="torch (test extra) is needed for the GradScaler oracle"
)
needs_jmp = pytest.mark.skipif(
  jmp is None, reason="jmp (test extra) is needed for the DynamicLossScale oracle"
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_LEN = 40
VALUES = {"f": 1.0, "inf": np.inf, "-inf": -np.inf, "nan": np.nan}
STEPS = st.lists(st.sampled_from(sorted(VALUES)), min_size=1, max_size=MAX_LEN)
TINY = 2.0**-126  # our smallest min_scale: 40 backoffs from >= 1 never reach it.
HUGE = 2.0**126  # our largest max_scale: 40 growths from <= 2**20 never reach it.


@functools.cache
def _ours(growth_factor, backoff_factor, growth_interval, min_scale, max_scale):
  """One compiled lax.scan over MAX_LEN steps per setting; init_scale is set in the state."""
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(0.1),
    init_scale=max(min_scale, 1.0),
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
    min_scale=min_scale,
    max_scale=max_scale,
  )
  params = {"w": jnp.zeros(2, jnp.float32)}

  def step(state, g):
    grads = {"w": g * optax_dls.find_state(state).loss_scale}
    _, state = tx.update(grads, state, params)
    m = optax_dls.metrics(state)
    return state, (m["loss_scale"], m["skipped"])

  @jax.jit
  def trajectory(init_scale, gs):
    state = tx.init(params)
    state = state._replace(loss_scale=init_scale)
    return jax.lax.scan(step, state, gs)[1]

  return trajectory


def run_ours(kinds, init_scale, **hp):
  """Scale and skip flag after each step. Steps past len(kinds) are padding ("f"):
  they come after every value read, so they cannot change it."""
  gs = np.ones((MAX_LEN, 2), np.float32)
  gs[: len(kinds), 0] = [VALUES[k] for k in kinds]
  scales, skipped = map(np.asarray, _ours(**hp)(jnp.float32(init_scale), jnp.asarray(gs)))
  n = len(kinds)
  return [float(s) for s in scales[:n]], [bool(s) for s in skipped[:n]]


def run_torch(kinds, init_scale, growth_factor, backoff_factor, growth_interval):
  """Drives a real GradScaler with a tiny param, SGD and gradients holding inf/NaN."""
  p = torch.nn.Parameter(torch.zeros(2))
  opt = torch.optim.SGD([p], lr=0.1)
  scaler = torch.amp.GradScaler(
    "cpu",
    init_scale=init_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
  )
  scales, skipped = [], []
  for k in kinds:
    scaler.scale(p.sum()).backward()
    with torch.no_grad():
      p.grad.copy_(torch.tensor([VALUES[k], 1.0]) * scaler.get_scale())
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scales.append(scaler.get_scale())
    skipped.append(bool(torch.equal(before, p.detach())))
  return scales, skipped


@functools.cache
def _jmp(factor, period):
  # jmp's tree_unflatten drops min_loss_scale (back to its default 1.0), so the
  # scanned adjust always floors at 1.0; the test uses min_scale=1.0 to match.
  def step(ls, g):
    grads = ls.unscale({"w": g * ls.loss_scale})
    ls = ls.adjust(jmp.all_finite(grads))
    return ls, ls.loss_scale

  @jax.jit
  def trajectory(init_scale, gs):
    ls = jmp.DynamicLossScale(init_scale, period=period, factor=factor)
    return jax.lax.scan(step, ls, gs)[1]

  return trajectory


def run_jmp(kinds, init_scale, factor, period):
  gs = np.ones((MAX_LEN, 2), np.float32)
  gs[: len(kinds), 0] = [VALUES[k] for k in kinds]
  scales = np.asarray(_jmp(factor, period)(jnp.float32(init_scale), jnp.asarray(gs)))
  return [float(s) for s in scales[: len(kinds)]]


@needs_torch
@SETTINGS
@given(
  kinds=STEPS,
  interval=st.integers(1, 3),
  init_exp=st.integers(0, 20),
  factors=st.sampled_from([(2.0, 0.5), (1.5, 0.75)]),
)
def test_scale_trajectory_equals_torch_grad_scaler(kinds, interval, init_exp, factors):
  # (1.5, 0.75): scales that are not powers of two check the float32 rounding too.
  init, (growth_factor, backoff_factor) = 2.0**init_exp, factors
  expected, torch_skipped = run_torch(kinds, init, growth_factor, backoff_factor, interval)
  got, skipped = run_ours(
    kinds,
    init_scale=init,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=interval,
    min_scale=TINY,
    max_scale=HUGE,
  )
  assert got == expected
  assert skipped == torch_skipped == [k != "f" for k in kinds]


@needs_jmp
@SETTINGS
@given(
  kinds=STEPS,
  interval=st.integers(1, 3),
  init_exp=st.integers(0, 20),
  factor=st.sampled_from([2, 4]),
)
def test_scale_trajectory_equals_jmp_dynamic_loss_scale(kinds, interval, init_exp, factor):
  # jmp floors at min_loss_scale=1.0 like our default min_scale, so the floor binds in both.
  init = 2.0**init_exp
  expected = run_jmp(kinds, init, factor, interval)
  got, _ = run_ours(
    kinds,
    init_scale=init,
    growth_factor=float(factor),
    backoff_factor=1.0 / factor,
    growth_interval=interval,
    min_scale=1.0,
    max_scale=HUGE,
  )
  assert got == expected


@needs_torch
def test_floor_is_torch_clamped_at_min_scale():
  # By design: torch has no floor (its scale goes to 0, and 1/S to inf); ours stops at min_scale.
  kinds = ["inf"] * 10 + ["f"] * 3 + ["nan"] * 3 + ["f"] * 4
  torch_scales, _ = run_torch(kinds, 16.0, 2.0, 0.5, 2)
  got, _ = run_ours(
    kinds,
    init_scale=16.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2,
    min_scale=1.0,
    max_scale=HUGE,
  )
  # Clamping torch's trajectory by hand only agrees until the first growth after the floor.
  floor_hits = [max(s, 1.0) for s in torch_scales[:10]]
  assert got[:10] == floor_hits
  assert got[:10] == [8.0, 4.0, 2.0] + [1.0] * 7
  assert torch_scales[9] == 2.0**-6  # torch went below our floor
  # After the floor our trajectory is our rule from S = 1 (pinned): grow on every 2nd clean step.
  assert got[10:] == [1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0]


@needs_torch
def test_ceiling_is_torch_clamped_at_max_scale():
  # By design: torch grows until the product would be inf; ours stops at max_scale.
  kinds = ["f"] * 12
  torch_scales, _ = run_torch(kinds, 2.0**20, 2.0, 0.5, 1)
  got, _ = run_ours(
    kinds,
    init_scale=2.0**20,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=1,
    min_scale=1.0,
    max_scale=2.0**24,
  )
  assert got == [min(s, 2.0**24) for s in torch_scales]
  assert torch_scales[-1] > 2.0**24 == got[-1]
