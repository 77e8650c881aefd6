"""Bad hyperparameters raise at construction, naming the argument and the value."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

INNER = optax.sgd(0.1)

BAD_VALUES = [  # (argument, value): out of the ranges of DESIGN section 5 and the docstrings
    ("growth_factor", 1.0), ("growth_factor", 0.5), ("growth_factor", math.inf), ("growth_factor", math.nan),
    ("backoff_factor", 0.0), ("backoff_factor", 1.0), ("backoff_factor", -0.5), ("backoff_factor", 2.0),
    ("growth_interval", 0), ("growth_interval", -3), ("growth_interval", 2**31),
    ("min_scale", 0.0), ("min_scale", -1.0), ("min_scale", math.inf), ("min_scale", 2.0**-127),
    ("max_scale", math.inf), ("max_scale", 2.0**127), ("max_scale", 0.5),  # 0.5 < min_scale=1
    ("init_scale", 0.5), ("init_scale", 2.0**25), ("init_scale", 0.0), ("init_scale", math.inf),
    ("init_scale", math.nan), ("hysteresis", 0), ("hysteresis", -1), ("warmup_steps", -1),
]


def _value_in(msg, value):
  return repr(value) in msg or repr(float(value)) in msg


@pytest.mark.parametrize("name,value", BAD_VALUES)
@pytest.mark.parametrize("factory", ["dynamic_policy", "dynamic_loss_scale"])
def test_out_of_range_raises_value_error_naming_argument_and_value(factory, name, value):
  build = (lambda **kw: optax_dls.dynamic_loss_scale(INNER, **kw)) if factory == "dynamic_loss_scale" \
      else optax_dls.dynamic_policy
  with pytest.raises(ValueError) as e:
    build(**{name: value})
  assert name in str(e.value) and _value_in(str(e.value), value), str(e.value)


@pytest.mark.parametrize("value", [0.0, -2.0, math.inf, math.nan, 2.0**127])
def test_static_scale_out_of_range(value):
  with pytest.raises(ValueError) as e:
    optax_dls.static_loss_scale(INNER, value)
  assert "scale" in str(e.value) and _value_in(str(e.value), value)
  with pytest.raises(ValueError):
    optax_dls.static_policy(value)


@pytest.mark.parametrize("name,value", [
    ("growth_interval", 2.5), ("growth_interval", "10"), ("hysteresis", True), ("warmup_steps", 1.0),
    ("init_scale", "1024"), ("growth_factor", None), ("backoff_factor", [0.5]),
    ("consecutive_hysteresis", 1),
])
def test_wrong_type_raises_type_error(name, value):
  with pytest.raises(TypeError, match=name):
    optax_dls.dynamic_loss_scale(INNER, **{name: value})
  with pytest.raises(TypeError, match=name):
    optax_dls.dynamic_policy(**{name: value})


def test_static_numbers_of_numpy_and_jax_types_are_accepted():
  tx = optax_dls.dynamic_loss_scale(INNER, init_scale=jnp.float32(2.0**10), growth_interval=np.int64(5),
                                    backoff_factor=np.float32(0.5), hysteresis=np.int32(2))
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


@pytest.mark.parametrize("kw,error", [
    ({"alert_after": 0}, ValueError), ({"fallback_after": 0}, ValueError),
    ({"fallback_after": 3, "fallback_steps": 0}, ValueError), ({"alerts": 1}, TypeError),
    ({"fallback_after": 2.5}, TypeError),
])
def test_monitoring_options_checked_in_both_presets(kw, error):
  name, value = next((k, v) for k, v in reversed(kw.items()))
  for build in (lambda: optax_dls.dynamic_loss_scale(INNER, **kw),
                lambda: optax_dls.static_loss_scale(INNER, 2.0, **kw)):
    with pytest.raises(error, match=name) as e:
      build()
    assert repr(value) in str(e.value)
