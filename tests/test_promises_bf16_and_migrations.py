"""docs/guide/bf16.md and the migration guides: the numbers and arguments they state."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dls


def test_the_bfloat16_and_float16_limits_the_page_states():
  """bf16.md: bfloat16 has float32's range (largest about 3.4e38, smallest normal
  2**-126 = 1.2e-38) and 8 significant bits against float16's 11; float16 underflows
  below 2**-24 = 6e-8."""
  bf16, f32, f16 = jnp.finfo(jnp.bfloat16), jnp.finfo(jnp.float32), jnp.finfo(jnp.float16)
  assert bf16.nexp == f32.nexp == 8 and bf16.nmant + 1 == 8 and f16.nmant + 1 == 11
  assert float(bf16.max) == pytest.approx(3.4e38, rel=0.01)
  assert float(bf16.tiny) == float(f32.tiny) == 2.0**-126 == pytest.approx(1.2e-38, rel=0.02)
  assert float(f16.smallest_subnormal) == 2.0**-24 == pytest.approx(6e-8, rel=0.01)
  assert float(jnp.float16(2.0**-25)) == 0.0  # below it: zero in float16, not in bfloat16
  assert float(jnp.bfloat16(2.0**-25)) == 2.0**-25


def test_torch_policy_follows_torch_down_to_2_126_and_stops_there():
  """migrate_torch.md: PyTorch's scale has no floor; torch_policy keeps its trajectory down
  to 2**-126, and dynamic_loss_scale stops at min_scale (1 by default)."""
  torch = pytest.importorskip("torch")
  scale = torch.full((1,), 2.0**-120, dtype=torch.float32)
  tracker = torch.zeros((1,), dtype=torch.int32)
  torch_scales = []
  for _ in range(8):  # every step overflows
    torch._amp_update_scale_(scale, tracker, torch.ones((1,)), 2.0, 0.5, 2)
    torch_scales.append(scale.item())
  assert torch_scales[-1] == 2.0**-128  # torch goes on below 2**-126
  for tx, floor in [
    (
      optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.config.preset("torch", init_scale=2.0**-120)),
      2.0**-126,
    ),
    (optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**3), 1.0),
  ]:
    params = {"w": jnp.zeros(2)}
    state, update, ours = tx.init(params), jax.jit(tx.update), []
    for _ in range(8):
      _, state = update({"w": jnp.array([1.0, jnp.inf])}, state, params)
      ours.append(float(optax_dls.find_state(state).loss_scale))
    assert ours[-1] == floor and min(ours) == floor
    if floor != 1.0:
      assert ours == [max(s, floor) for s in torch_scales]


def _parameters(f, drop=()):
  return {
    k: v.default
    for k, v in inspect.signature(f).parameters.items()
    if k not in ("self", *drop) and v.kind is not inspect.Parameter.VAR_KEYWORD
  }


def test_the_presets_take_their_reference_s_arguments_with_its_defaults():
  """migrate_flax.md, migrate_jmp.md, migrate_torch.md: the presets "flax", "jmp" and
  "torch" take DynamicScale's, jmp.DynamicLossScale's and GradScaler's arguments."""
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  fields = {f.name: f.default for f in dataclasses.fields(dynamic_scale.DynamicScale)}
  del fields["fin_steps"]  # the run's state, carried over by optax_dls.flax.from_dynamic_scale
  assert _parameters(optax_dls.config._FRAMEWORKS["flax"]) == pytest.approx(fields)
  torch = pytest.importorskip("torch")
  assert _parameters(optax_dls.config._FRAMEWORKS["torch"]) == _parameters(
    torch.amp.GradScaler.__init__, drop=("device", "enabled")
  )
  jmp = pytest.importorskip("jmp")
  ours = _parameters(optax_dls.config._FRAMEWORKS["jmp"])
  theirs = _parameters(jmp.DynamicLossScale.__init__, drop=("counter",))  # the run's state
  assert list(ours) == list(theirs)
  assert (ours["period"], ours["factor"]) == (theirs["period"], theirs["factor"])
  assert float(jmp.DynamicLossScale(1.0).min_loss_scale) == ours["min_loss_scale"]
