"""The promises of the framework presets of ``optax_dls.config.preset``: defaults, ranges
and the bounds where a reference leaves ``[2**-126, 2**126]``."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_dls
from optax_dls._policies.base import GradStats

LOW, HIGH = 2.0**-126, 2.0**126
_named = optax_dls.config.preset


def _defaults(fn):
  return {k: p.default for k, p in inspect.signature(fn).parameters.items()}


def _ours(name):
  """The arguments ``optax_dls.config.preset(name, ...)`` takes, with their defaults."""
  return _defaults(optax_dls.config._FRAMEWORKS[name])


def _preset(name):
  return functools.partial(optax_dls.config.preset, name)


def _reference(name):
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      return importlib.import_module(name)
  except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
    pytest.skip(f"{name} does not import here: {type(e).__name__}: {e}")


def test_torch_policy_has_grad_scaler_s_names_and_defaults():
  torch = _reference("torch")
  theirs = _defaults(torch.amp.GradScaler.__init__)
  ours = _ours("torch")
  assert ours == {k: theirs[k] for k in ours}


def test_flax_policy_has_dynamic_scale_s_defaults():
  dynamic_scale = _reference("flax.training.dynamic_scale")
  theirs = {f.name: f.default for f in dataclasses.fields(dynamic_scale.DynamicScale)}
  ours = _ours("flax")
  assert ours == {k: float(theirs[k]) if k == "minimum_scale" else theirs[k] for k in ours}


def test_jmp_policy_has_jmp_s_defaults():
  jmp = _reference("jmp")
  theirs = jmp.DynamicLossScale(jnp.float32(4.0))
  ours = _ours("jmp")
  assert ours["loss_scale"] is inspect.Parameter.empty  # required, as in jmp
  assert (ours["period"], ours["factor"]) == (theirs.period, theirs.factor)
  assert ours["min_loss_scale"] == float(theirs.min_loss_scale)


def test_keras_megatron_deepspeed_defaults_are_the_documented_ones():
  assert _ours("keras") == {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}
  assert _ours("megatron") == {
    "initial_scale": 2.0**32,
    "min_scale": 1.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
    "hysteresis": 2,
  }
  assert _ours("deepspeed") == {
    "init_scale": 2.0**16,
    "scale_window": 1000,
    "min_scale": 1.0,
    "delayed_shift": 2,
    "consecutive_hysteresis": False,
  }


def _scales(policy, finite):
  scale, state = policy.init()
  out = []
  for f in finite:
    stats = GradStats(
      finite=jnp.asarray(f), step=jnp.asarray(0, jnp.int32), grad_norm=jnp.float32(1.0)
    )
    scale, state = policy.update(scale, state, stats)
    out.append(float(scale))
  return out


def test_where_a_reference_leaves_the_range_the_scale_stops_at_its_bounds():
  assert _scales(_named("torch", init_scale=HIGH, growth_interval=1), [True] * 2) == [HIGH] * 2
  assert _scales(_named("torch", init_scale=LOW), [False] * 2) == [LOW] * 2
  assert _scales(_named("keras", initial_scale=LOW), [False] * 2) == [LOW] * 2
  assert _scales(_named("jmp", loss_scale=HIGH, period=1), [True] * 2) == [HIGH] * 2
  # minimum_scale=None (no floor in flax) floors at 2**-126.
  assert _scales(_named("flax", scale=2.0**-125, minimum_scale=None), [False] * 3) == [LOW] * 3


@pytest.mark.parametrize(
  "call, name, top",
  [
    (_preset("torch"), "growth_interval", 2**31 - 2),
    (_preset("keras"), "dynamic_growth_steps", 2**31 - 2),
    (_preset("flax"), "growth_interval", 2**31 - 3),
    (_preset("deepspeed"), "scale_window", 2**31 - 3),
    (_preset("megatron"), "hysteresis", 2**31 - 2),
  ],
)
def test_the_windows_take_exactly_their_documented_range(call, name, top):
  call(**{name: top})
  with pytest.raises(ValueError, match=name):
    call(**{name: top + 1})


def test_flax_policy_takes_a_growth_interval_of_0_and_grows_on_every_finite_step():
  assert _scales(_named("flax", scale=4.0, growth_interval=0), [True] * 2) == [
    8.0,
    16.0,
  ]
  with pytest.raises(ValueError, match="growth_interval"):
    _named("flax", growth_interval=-1)


def _deepspeed_rule(config, overflows):
  """The rule ``deepspeed_policy``'s docstring states, step by step in Python: a growth by 2
  when ``stable = cur_iter - last_overflow_iter - 1`` is a positive multiple of
  ``scale_window``; an overflow spends one unit of hysteresis and, once it is spent, halves
  the scale (floored at ``min_scale``); a growth refills the hysteresis, or every finite step
  with ``consecutive_hysteresis``."""
  scale, last_overflow, left = config["init_scale"], -1, config["delayed_shift"]
  out = []
  for it, overflow in enumerate(overflows):
    if overflow:
      if left == 1:
        scale = max(scale / 2, config["min_scale"])
      else:
        left -= 1
      last_overflow = it
    else:
      if config["consecutive_hysteresis"]:
        left = config["delayed_shift"]
      stable = it - last_overflow - 1
      if stable > 0 and stable % config["scale_window"] == 0:
        scale *= 2
        left = config["delayed_shift"]
    out.append(scale)
  return out


_DS_CONFIGS = [
  dict(init_scale=2.0**3, scale_window=2, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=c)
  for c in (False, True)
] + [
  dict(
    init_scale=2.0**10,
    scale_window=3,
    min_scale=0.25,
    delayed_shift=3,
    consecutive_hysteresis=False,
  )
]
_DS_LENGTH = 32


@functools.cache
def _deepspeed_scan(index):
  policy = _named("deepspeed", **_DS_CONFIGS[index])

  def step(carry, finite):
    scale, state = carry
    stats = GradStats(
      finite=finite, step=jnp.zeros([], jnp.int32), grad_norm=jnp.zeros([], jnp.float32)
    )
    carry = policy.update(scale, state, stats)
    return carry, carry[0]

  return jax.jit(lambda finite: jax.lax.scan(step, policy.init(), finite)[1])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
  overflows=st.lists(
    st.sampled_from([False, False, False, True]), min_size=_DS_LENGTH, max_size=_DS_LENGTH
  ),
  index=st.sampled_from(range(len(_DS_CONFIGS))),
)
def test_deepspeed_policy_follows_the_rule_its_docstring_states(overflows, index):
  """Held here without DeepSpeed installed; tests/test_compat.py compares with DeepSpeed itself."""
  got = _deepspeed_scan(index)(jnp.asarray([not o for o in overflows]))
  assert [float(s) for s in got] == _deepspeed_rule(_DS_CONFIGS[index], overflows)


@pytest.mark.parametrize(
  "preset",
  [
    _preset("torch"),
    _preset("keras"),
    lambda: _named("jmp", loss_scale=2.0**15),
    _preset("flax"),
    _preset("megatron"),
    _preset("deepspeed"),
  ],
)
def test_every_preset_has_the_dynamic_rule_s_state(preset):
  scale, state = preset().init()
  assert set(state._fields) == {"growth_tracker", "hysteresis_left"}
  assert scale.dtype == jnp.float32
