"""Compatibility presets against the real loss scalers, on random finite / inf / NaN sequences.

Oracles are the installed packages (PyTorch GradScaler, jmp, flax DynamicScale,
Keras 3 LossScaleOptimizer on the JAX backend, Megatron-core DynamicGradScaler,
DeepSpeed DynamicLossScaler); a test skips, saying why, when its package does
not import. Scales are compared for equality (bit for bit), every step.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import optax_dls
from optax_dls._policies.base import GradStats

LENGTH = 40  # padded sequence length: one compilation per configuration
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True)
VALUES = {"F": 1.0, "I": np.inf, "N": np.nan, "M": -np.inf}
seqs = st.lists(st.sampled_from("FFFFIN"), min_size=1, max_size=LENGTH).map("".join)


def _import(name: str):
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      return importlib.import_module(name)
  except Exception as e:  # noqa: BLE001 - any import failure means "no oracle here"
    pytest.skip(f"oracle {name} does not import here: {type(e).__name__}: {e}")


@functools.cache
def _trajectory_fn(preset: str, config: tuple):
  """Jitted scan of the preset's policy over a padded bool sequence, cached per config."""
  policy = optax_dls.config.preset(preset, **dict(config))

  def step(carry, finite):
    scale, state = carry
    stats = GradStats(
      finite=finite, step=jnp.zeros([], jnp.int32), grad_norm=jnp.zeros([], jnp.float32)
    )
    scale, state = policy.update(scale, state, stats)
    return (scale, state), scale

  return jax.jit(lambda finite: lax.scan(step, policy.init(), finite)[1])


def ours(preset: str, config: dict, seq: str) -> list[float]:
  finite = np.ones([LENGTH], bool)
  finite[: len(seq)] = [c == "F" for c in seq]
  out = np.asarray(_trajectory_fn(preset, tuple(sorted(config.items())))(jnp.asarray(finite)))
  return [float(x) for x in out[: len(seq)]]


TORCH_CONFIGS = [
  dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
  dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
  dict(init_scale=3.0 * 2**10, growth_factor=1.5, backoff_factor=0.75, growth_interval=2),
  dict(init_scale=1.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=5),
]


@SETTINGS
@given(seq=seqs, config=st.sampled_from(TORCH_CONFIGS))
def test_torch_grad_scaler(seq, config):
  torch = _import("torch")
  # GradScaler.update() runs this kernel (aten AmpGradScalerKernels); the whole
  # GradScaler is checked end to end in test_presets_inside_the_wrapper_follow_torch.
  scale = torch.full((1,), config["init_scale"], dtype=torch.float32)
  tracker = torch.zeros((1,), dtype=torch.int32)
  expected = []
  for c in seq:
    found_inf = torch.full((1,), float(c != "F"))
    torch._amp_update_scale_(
      scale,
      tracker,
      found_inf,
      config["growth_factor"],
      config["backoff_factor"],
      config["growth_interval"],
    )
    expected.append(scale.item())
  assert ours("torch", config, seq) == expected


KERAS_CONFIGS = [dict(initial_scale=2.0**15, dynamic_growth_steps=n) for n in (1, 2, 4)]


@functools.cache
def _keras_apply(keras, steps: int, initial_scale: float):
  opt = keras.optimizers.LossScaleOptimizer(
    keras.optimizers.SGD(0.1), initial_scale=initial_scale, dynamic_growth_steps=steps
  )
  var = keras.Variable(np.zeros(2, np.float32))
  opt.build([var])
  index = [v.path.endswith("dynamic_scale") for v in opt.variables].index(True)
  apply = jax.jit(lambda ov, g, tv: opt.stateless_apply(ov, [g], tv))
  return apply, [v.value for v in opt.variables], [var.value], index


@SETTINGS
@given(seq=seqs, config=st.sampled_from(KERAS_CONFIGS))
def test_keras_loss_scale_optimizer(seq, config):
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = _import("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"keras runs on the {keras.backend.backend()} backend here, the oracle needs jax")
  apply, opt_vars, train_vars, index = _keras_apply(
    keras, config["dynamic_growth_steps"], config["initial_scale"]
  )
  expected = []
  for c in seq:
    train_vars, opt_vars = apply(opt_vars, jnp.full([2], VALUES[c], jnp.float32), train_vars)
    expected.append(float(opt_vars[index]))
  assert ours("keras", config, seq) == expected


JMP_CONFIGS = [
  dict(loss_scale=2.0**15, period=1, factor=2, min_loss_scale=1.0),
  dict(loss_scale=2.0**4, period=3, factor=2, min_loss_scale=1.0),
  dict(loss_scale=2.0**10, period=2, factor=3, min_loss_scale=0.5),
]


@functools.cache
def _jmp_scan(jmp, config: tuple):
  c = dict(config)
  ls = jmp.DynamicLossScale(
    jnp.float32(c["loss_scale"]),
    period=c["period"],
    factor=c["factor"],
    min_loss_scale=jnp.float32(c["min_loss_scale"]),
  )

  def step(ls, finite):
    ls = ls.adjust(finite)
    return ls, ls.loss_scale

  return jax.jit(lambda finite: lax.scan(step, ls, finite)[1])


@SETTINGS
@given(seq=seqs, config=st.sampled_from(JMP_CONFIGS))
def test_jmp_dynamic_loss_scale(seq, config):
  jmp = _import("jmp")
  finite = np.ones([LENGTH], bool)
  finite[: len(seq)] = [c == "F" for c in seq]
  expected = np.asarray(_jmp_scan(jmp, tuple(sorted(config.items())))(jnp.asarray(finite)))
  assert ours("jmp", config, seq) == [float(x) for x in expected[: len(seq)]]


FLAX_CONFIGS = [
  dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=0, scale=2.0**16),
  dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, scale=2.0**16),
  dict(growth_factor=1.5, backoff_factor=0.75, growth_interval=1, scale=3.0),
]


@functools.cache
def _flax_scan(dynamic_scale_cls, config: tuple):
  ds = dynamic_scale_cls(**dict(config))

  def step(ds, value):
    ds, *_ = ds.value_and_grad(lambda x: jnp.sum(x * value))(jnp.ones([2], jnp.float32))
    return ds, ds.scale

  return jax.jit(lambda values: lax.scan(step, ds, values)[1])


@SETTINGS
@given(seq=seqs, config=st.sampled_from(FLAX_CONFIGS))
def test_flax_dynamic_scale(seq, config):
  module = _import("flax.training.dynamic_scale")
  values = np.ones([LENGTH], np.float32)
  values[: len(seq)] = [VALUES[c] for c in seq]
  expected = np.asarray(
    _flax_scan(module.DynamicScale, tuple(sorted(config.items())))(jnp.asarray(values))
  )
  assert ours("flax", config, seq) == [float(x) for x in expected[: len(seq)]]


MEGATRON_CONFIGS = [
  dict(
    initial_scale=2.0**32,
    min_scale=1.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2,
    hysteresis=2,
  ),
  dict(
    initial_scale=2.0**4,
    min_scale=1.0,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=1,
    hysteresis=1,
  ),
  dict(
    initial_scale=96.0,
    min_scale=0.75,
    growth_factor=1.5,
    backoff_factor=0.25,
    growth_interval=3,
    hysteresis=3,
  ),
]


@SETTINGS
@given(seq=seqs, config=st.sampled_from(MEGATRON_CONFIGS))
def test_megatron_dynamic_grad_scaler(seq, config):
  torch = _import("torch")
  module = _import("megatron.core.optimizer.grad_scaler")
  real_tensor = torch.tensor

  def cpu_tensor(*args, device=None, **kwargs):  # the class hard-codes device='cuda'
    return real_tensor(*args, **kwargs)

  with mock.patch.object(torch, "tensor", cpu_tensor):
    scaler = module.DynamicGradScaler(**config)
  expected = []
  for c in seq:
    scaler.update(c != "F")
    expected.append(float(scaler.scale.item()))
  assert ours("megatron", config, seq) == expected


DEEPSPEED_CONFIGS = [
  dict(
    init_scale=2.0**16, scale_window=1, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False
  ),
  dict(
    init_scale=2.0**3, scale_window=2, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False
  ),
  dict(
    init_scale=2.0**3, scale_window=2, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=True
  ),
  dict(
    init_scale=2.0**10,
    scale_window=3,
    min_scale=0.25,
    delayed_shift=3,
    consecutive_hysteresis=False,
  ),
]


@SETTINGS
@given(seq=seqs, config=st.sampled_from(DEEPSPEED_CONFIGS))
def test_deepspeed_dynamic_loss_scaler(seq, config):
  module = _import("deepspeed.runtime.fp16.loss_scaler")
  scaler = module.DynamicLossScaler(**config)
  expected = []
  with mock.patch.object(module.dist, "get_rank", lambda *a, **k: 1):  # no process group on CPU
    for c in seq:
      try:
        scaler.update_scale(c != "F")
      except Exception as e:  # noqa: BLE001 - DeepSpeed raises at min_scale; ours stays there
        assert "minimum" in str(e)
        break
      expected.append(float(scaler.cur_scale))
  assert ours("deepspeed", config, seq)[: len(expected)] == expected


def test_hysteresis_sequences_of_the_reference_table():
  # Failure kind 9 of docs/design.md, with Megatron (refill on growth) and DeepSpeed
  # (consecutive) presets.
  def run(policy_fn, seq):
    return ours(
      policy_fn,
      dict(
        init_scale=2.0**16,
        scale_window=1000,
        delayed_shift=2,
        consecutive_hysteresis=policy_fn == "deepspeed",
      ),
      seq,
    )

  assert run("deepspeed", "IFI") == [2.0**16, 2.0**16, 2.0**16]
  assert ours("megatron", dict(initial_scale=2.0**16), "IFI") == [2.0**16, 2.0**16, 2.0**15]
  assert ours("megatron", dict(initial_scale=2.0**16), "III") == [2.0**16, 2.0**15, 2.0**14]


def test_growth_timing_differs_between_references():
  # The same eight clean steps: torch grows on the 4th and 8th, flax on the 5th,
  # DeepSpeed on the 5th then every 4th (so also the 9th, not reached here).
  seq = "FFFFFFFF"
  torch_traj = ours("torch", dict(init_scale=1.0, growth_interval=4), seq)
  flax_traj = ours("flax", dict(scale=1.0, growth_interval=4), seq)
  ds_traj = ours("deepspeed", dict(init_scale=1.0, scale_window=4), seq)
  assert torch_traj == [1, 1, 1, 2, 2, 2, 2, 4]
  assert flax_traj == [1, 1, 1, 1, 2, 2, 2, 2]
  assert ds_traj == [1, 1, 1, 1, 2, 2, 2, 2]
  assert ours("deepspeed", dict(init_scale=1.0, scale_window=4), seq + "F")[-1] == 4.0


def test_presets_inside_the_wrapper_follow_torch():
  torch = _import("torch")
  config = dict(init_scale=2.0**4, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
  tx = optax_dls.loss_scaled(optax.sgd(0.5), optax_dls.config.preset("torch", **config))
  params = {"w": jnp.zeros([3])}
  state = tx.init(params)
  update = jax.jit(tx.update)
  p = torch.nn.Parameter(torch.zeros(3))
  opt = torch.optim.SGD([p], lr=0.5)
  scaler = torch.amp.GradScaler("cpu", **config)
  for c in "FFFIFNFFFFIIF":
    grads = {"w": jnp.full([3], VALUES[c], jnp.float32) * optax_dls.find_state(state).loss_scale}
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((3,), VALUES[c]) * scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert float(optax_dls.find_state(state).loss_scale) == scaler.get_scale()
    np.testing.assert_array_equal(np.asarray(params["w"]), p.detach().numpy())


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda: optax_dls.config.preset("torch", growth_factor=1.0), "growth_factor"),
    (lambda: optax_dls.config.preset("torch", init_scale=0.0), "init_scale"),
    (lambda: optax_dls.config.preset("keras", dynamic_growth_steps=0), "dynamic_growth_steps"),
    (lambda: optax_dls.config.preset("jmp", loss_scale=2.0, min_loss_scale=4.0), "loss_scale"),
    (lambda: optax_dls.config.preset("flax", backoff_factor=1.0), "backoff_factor"),
    (lambda: optax_dls.config.preset("megatron", hysteresis=0), "hysteresis"),
    (lambda: optax_dls.config.preset("deepspeed", scale_window=0), "scale_window"),
    (lambda: optax_dls.config.preset("deepspeed", init_scale=float("inf")), "init_scale"),
  ],
)
def test_bad_hyperparameters_raise_value_error_naming_them(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_traced_hyperparameter_raises_type_error():
  with pytest.raises(TypeError, match="growth_interval"):
    jax.jit(lambda n: optax_dls.config.preset("torch", growth_interval=n))(3)
  with pytest.raises(TypeError, match="consecutive_hysteresis"):
    optax_dls.config.preset("deepspeed", consecutive_hysteresis=1)
