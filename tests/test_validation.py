"""Bad hyperparameters raise at construction, naming the argument and the value."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls import _policies

INNER = optax.sgd(0.1)

BAD_VALUES = [  # (argument, value): out of the ranges in docs/design.md and the docstrings
  ("growth_factor", 1.0),
  ("growth_factor", 0.5),
  ("growth_factor", math.inf),
  ("growth_factor", math.nan),
  ("backoff_factor", 0.0),
  ("backoff_factor", 1.0),
  ("backoff_factor", -0.5),
  ("backoff_factor", 2.0),
  ("growth_interval", 0),
  ("growth_interval", -3),
  ("growth_interval", 2**31),
  ("min_scale", 0.0),
  ("min_scale", -1.0),
  ("min_scale", math.inf),
  ("min_scale", 2.0**-127),
  ("max_scale", math.inf),
  ("max_scale", 2.0**127),
  ("max_scale", 0.5),  # 0.5 < min_scale=1
  ("init_scale", 0.5),
  ("init_scale", 2.0**25),
  ("init_scale", 0.0),
  ("init_scale", math.inf),
  ("init_scale", math.nan),
  ("hysteresis", 0),
  ("hysteresis", -1),
  ("warmup_steps", -1),
]


def _value_in(msg, value):
  return repr(value) in msg or repr(float(value)) in msg


@pytest.mark.parametrize("name,value", BAD_VALUES)
@pytest.mark.parametrize("factory", ["dynamic_policy", "dynamic_loss_scale"])
def test_out_of_range_raises_value_error_naming_argument_and_value(factory, name, value):
  build = (
    (lambda **kw: optax_dls.dynamic_loss_scale(INNER, **kw))
    if factory == "dynamic_loss_scale"
    else optax_dls.dynamic_policy
  )
  with pytest.raises(ValueError) as e:
    build(**{name: value})
  assert name in str(e.value) and _value_in(str(e.value), value), str(e.value)


@pytest.mark.parametrize("value", [0.0, -2.0, math.inf, math.nan, 2.0**127])
def test_static_scale_out_of_range(value):
  with pytest.raises(ValueError) as e:
    optax_dls.static_loss_scale(INNER, value)
  assert "scale" in str(e.value) and _value_in(str(e.value), value)
  with pytest.raises(ValueError):
    _policies.static_policy(value)


@pytest.mark.parametrize(
  "name,value",
  [
    ("growth_interval", 2.5),
    ("growth_interval", "10"),
    ("hysteresis", True),
    ("warmup_steps", 1.0),
    ("init_scale", "1024"),
    ("growth_factor", None),
    ("backoff_factor", [0.5]),
    ("consecutive_hysteresis", 1),
  ],
)
def test_wrong_type_raises_type_error(name, value):
  with pytest.raises(TypeError, match=name):
    optax_dls.dynamic_loss_scale(INNER, **{name: value})
  with pytest.raises(TypeError, match=name):
    optax_dls.dynamic_policy(**{name: value})


def test_static_numbers_of_numpy_and_jax_types_are_accepted():
  tx = optax_dls.dynamic_loss_scale(
    INNER,
    init_scale=jnp.float32(2.0**10),
    growth_interval=np.int64(5),
    backoff_factor=np.float32(0.5),
    hysteresis=np.int32(2),
  )
  assert float(tx.init({"w": jnp.zeros(1)}).loss_scale) == 2.0**10


@pytest.mark.parametrize("name", ["init_scale", "growth_factor", "growth_interval"])
def test_traced_hyperparameter_raises_type_error(name):
  value = {"init_scale": 8.0, "growth_factor": 2.0, "growth_interval": 3}[name]

  def build(v):
    return optax_dls.dynamic_loss_scale(INNER, **{name: v}).init({"w": jnp.zeros(1)})

  with pytest.raises(TypeError, match=f"{name}.*traced"):
    jax.jit(build)(value)
  with pytest.raises(TypeError, match="scale.*traced"):
    jax.jit(lambda s: optax_dls.static_loss_scale(INNER, s))(4.0)


def test_loss_scaled_argument_checks():
  with pytest.raises(TypeError, match="policy"):
    optax_dls.loss_scaled(INNER, {"init": None})
  with pytest.raises(TypeError, match="policy"):
    optax_dls.loss_scaled(INNER, optax_dls.dynamic_policy)  # the factory, not a policy
  with pytest.raises(TypeError, match="callable"):
    optax_dls.loss_scaled(INNER, optax_dls.LossScalePolicy(1.0, 2.0))
  with pytest.raises(ValueError, match="stats"):
    optax_dls.loss_scaled(INNER, optax_dls.dynamic_policy()._replace(stats=("median",)))
  with pytest.raises(TypeError, match="inner"):
    optax_dls.loss_scaled(lambda g: g, optax_dls.dynamic_policy())
  for bad in (3, ("data", 1), (), [None]):
    with pytest.raises(TypeError, match="axis_name"):
      optax_dls.loss_scaled(INNER, optax_dls.dynamic_policy(), axis_name=bad)
    with pytest.raises(TypeError, match="axis_name"):
      optax_dls.dynamic_loss_scale(INNER, axis_name=bad)
  ok = optax_dls.loss_scaled(INNER, optax_dls.dynamic_policy(), axis_name=["data", "model"])
  assert isinstance(ok, optax.GradientTransformationExtraArgs)


def test_reset_scale_value_checked():
  state = optax_dls.dynamic_loss_scale(INNER).init({"w": jnp.zeros(1)})
  for bad in (0.0, -1.0, math.inf, 2.0**127):
    with pytest.raises(ValueError, match="value"):
      optax_dls.reset_scale(state, bad)
  with pytest.raises(TypeError, match="value"):
    optax_dls.reset_scale(state, "8")


@pytest.mark.parametrize(
  "kw,error",
  [
    ({"after": 0}, ValueError),
    ({"steps": 0}, ValueError),
    ({"after": 2.5}, TypeError),
    ({"scale": math.nan}, ValueError),
    ({"steps": "x"}, TypeError),
  ],
)
def test_fallback_options_checked_around_every_policy(kw, error):
  name, value = next(iter(kw.items()))
  for policy in (optax_dls.dynamic_policy(), _policies.static_policy(2.0), optax_dls.amax_policy()):
    with pytest.raises(error, match=name) as e:
      optax_dls.fp32_fallback(policy, **kw)
    assert repr(value) in str(e.value)


@pytest.mark.parametrize(
  "kw",
  [
    {"alerts": True},
    {"alert_after": 3},
    {"fallback_after": 3},
    {"underflow_stats": True},
    {"growth_intervall": 3},
  ],
)
def test_options_that_are_not_the_policy_s_are_refused_by_name(kw):
  with pytest.raises(TypeError, match=next(iter(kw))):
    optax_dls.dynamic_loss_scale(INNER, **kw)


# --- Values valid as Python floats but not once rounded to float32 ------------------

F32_BAD = [
  ("growth_factor", 1 + 1e-9),
  ("growth_factor", 1e300),
  ("backoff_factor", 1 - 1e-9),
  ("backoff_factor", 1e-50),
]


@pytest.mark.parametrize("name,value", F32_BAD)
@pytest.mark.parametrize(
  "factory",
  [
    optax_dls.dynamic_policy,
    functools.partial(optax_dls.config.preset, "torch"),
    optax_dls.amax_policy,
    functools.partial(optax_dls.config.preset, "megatron"),
  ],
  ids=["dynamic_policy", "preset-torch", "amax_policy", "preset-megatron"],
)
def test_factors_that_round_to_one_or_zero_in_float32_are_refused(factory, name, value):
  with pytest.raises(ValueError, match=f"{name}.*float32") as e:
    factory(**{name: value})
  assert repr(value) in str(e.value) and "rounds to" in str(e.value)


@pytest.mark.parametrize(
  "build",
  [
    lambda: optax_dls.config.preset("jmp", loss_scale=1024.0, factor=1 + 1e-9),
    lambda: optax_dls.config.preset("flax", growth_factor=1 + 1e-9),
    lambda: optax_dls.config.preset("flax", backoff_factor=1 - 1e-9),
    lambda: optax_dls.dynamic_loss_scale(INNER, backoff_factor=1 - 1e-9),
  ],
)
def test_presets_check_factors_in_float32(build):
  with pytest.raises(ValueError, match="rounds to"):
    build()


@pytest.mark.parametrize(
  "build",
  [
    lambda: optax_dls.dynamic_loss_scale(INNER, init_scale=10**400),
    lambda: optax_dls.static_loss_scale(INNER, 10**400),
    lambda: optax_dls.config.preset("torch", growth_factor=10**400),
    lambda: optax_dls.reset_scale(
      optax_dls.dynamic_loss_scale(INNER).init({"w": jnp.zeros(1)}), 10**400
    ),
  ],
)
def test_huge_python_ints_raise_value_error_not_overflow(build):
  with pytest.raises(ValueError, match="too large"):
    build()


@pytest.mark.parametrize(
  "kw",
  [
    {"fallback_steps": 0},
    {"fallback_steps": "x"},
    {"fallback_scale": 0.0},
    {"fallback_scale": math.nan},
  ],
)
def test_fallback_options_in_a_config(kw):
  ((name, _),) = kw.items()
  with pytest.raises(
    (ValueError, TypeError), match="fallback"
  ):  # meaningless without fallback_after
    optax_dls.config.from_config(kw, INNER)
  with pytest.raises((ValueError, TypeError), match=name.removeprefix("fallback_")):
    optax_dls.config.from_config({"fallback_after": 2, **kw}, INNER)


# --- Bools: Python and NumPy bools accepted, others and traced ones refused ----------


def test_numpy_bools_are_accepted_everywhere_a_bool_is():
  optax_dls.dynamic_loss_scale(INNER, consecutive_hysteresis=np.bool_(True))
  optax_dls.config.preset("deepspeed", consecutive_hysteresis=np.bool_(True))
  optax_dls.value_and_grad(
    lambda x: x, optax_dls.dynamic_loss_scale(INNER), has_aux=np.bool_(False)
  )


def test_traced_and_non_bool_flags_are_refused():
  with pytest.raises(TypeError, match="consecutive_hysteresis.*traced"):
    jax.jit(lambda b: optax_dls.dynamic_policy(consecutive_hysteresis=b) and b)(True)
  with pytest.raises(TypeError, match="consecutive_hysteresis"):
    optax_dls.dynamic_loss_scale(INNER, consecutive_hysteresis=1)
  with pytest.raises(TypeError, match="consecutive_hysteresis"):
    optax_dls.config.preset("deepspeed", consecutive_hysteresis="yes")


# --- What a custom policy returns ------------------------------------------------------

DSS = _policies.DynamicScaleState


def _policy(scale=8.0, update=None, **kw):
  init = lambda: (
    scale() if callable(scale) else jnp.asarray(scale, jnp.float32),
    DSS(jnp.zeros([], jnp.int32), jnp.ones([], jnp.int32)),
  )
  return optax_dls.LossScalePolicy(init, update or (lambda s, st, stats: (s, st)), **kw)


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(stats=None), TypeError, "stats"),
    (dict(passthrough="no"), TypeError, "passthrough"),
    (dict(passthrough=1), TypeError, "passthrough"),
    (dict(scale=1024.0, passthrough=True), ValueError, "passthrough=True.*1"),
    (dict(scale=0.0), ValueError, "finite and > 0"),
    (dict(scale=-4.0), ValueError, "finite and > 0"),
    (dict(scale=math.inf), ValueError, "finite and > 0"),
    (dict(scale=math.nan), ValueError, "finite and > 0"),
    (dict(scale=jnp.ones(2)), ValueError, r"shape \(\)"),
    (dict(scale=lambda: "x"), ValueError, "float32"),
  ],
)
def test_policy_init_and_fields_checked_at_construction(kw, error, match):
  with pytest.raises(error, match=match):
    optax_dls.loss_scaled(INNER, _policy(**kw))


def test_policy_state_must_be_arrays():
  policy = optax_dls.LossScalePolicy(
    lambda: (jnp.float32(2.0), {"n": 0}), lambda s, st, stats: (s, st)
  )
  with pytest.raises(TypeError, match="pytree of arrays"):
    optax_dls.loss_scaled(INNER, policy)


@pytest.mark.parametrize(
  "update, match",
  [
    (lambda s, st, stats: s, "pair"),
    (lambda s, st, stats: (jnp.full(3, s), st), r"shape \(\)"),
    (lambda s, st, stats: (jnp.int32(4), st), "floating"),
    (lambda s, st, stats: (s, None), "tree structure"),
    (lambda s, st, stats: (s, jax.tree.map(lambda x: x.astype(jnp.float32), st)), "dtypes"),
  ],
)
def test_policy_update_output_checked_at_trace_time(update, match):
  tx = optax_dls.loss_scaled(INNER, _policy(update=update))
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match=f"policy.update.*{match}"):
    jax.eval_shape(tx.update, params, tx.init(params), params)


# --- Access helpers -------------------------------------------------------------------


def test_reset_scale_traced_value_must_be_a_scalar():
  state = optax_dls.dynamic_loss_scale(INNER).init({"w": jnp.zeros(1)})
  with pytest.raises(ValueError, match=r"value.*shape \(3,\)"):
    jax.jit(optax_dls.reset_scale)(state, jnp.ones(3))


@pytest.mark.parametrize("loss", ["1.0", None, b"1"])
def test_scale_loss_non_numeric_loss_raises_type_error(loss):
  state = optax_dls.dynamic_loss_scale(INNER).init({"w": jnp.zeros(1)})
  with pytest.raises(TypeError, match="loss"):
    optax_dls.scale_loss(loss, state)


def test_underflow_labels_and_amax_statistic_of_wrong_type_raise_type_error():
  with pytest.raises(TypeError, match="statistic"):
    optax_dls.amax_policy(statistic=None)
  with pytest.raises(TypeError, match="label"):
    optax_dls.underflow_stats({"w": 1})


def test_all_finite_checks_its_arguments():
  with pytest.raises(TypeError, match="axis_name"):
    optax_dls.all_finite(jnp.ones(2), axis_name=5)
  with pytest.raises(TypeError, match="tree.*'abc'"):
    optax_dls.all_finite("abc")
  assert bool(optax_dls.all_finite({"a": jnp.ones(2), "n": None, "i": 3}))


def test_update_names_a_wrong_state():
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  params = {"w": jnp.ones(3)}
  plain_state = optax.adam(1e-3).init(params)
  with pytest.raises(TypeError, match="opt_state must be .*LossScaleState.*got a tuple"):
    tx.update(params, plain_state, params)


def test_all_finite_takes_python_numbers():
  assert bool(optax_dls.all_finite([1.0, 2])) and bool(optax_dls.all_finite(1e30))
  assert not bool(optax_dls.all_finite({"a": 2.0, "b": float("inf")}))
  assert not bool(optax_dls.all_finite(float("nan")))
