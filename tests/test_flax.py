"""optax_dls.flax: loss-scaled value_and_grad with linen TrainState and nnx.Optimizer."""

import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import optax_dls
import optax_dls.flax as dls_flax

S0 = 2.0**10
X = jnp.array([[1.0, -2.0], [0.5, 3.0]], jnp.float32)
Y = jnp.array([[1.0], [-1.0]], jnp.float32)
X_BAD = X.at[0, 0].set(jnp.inf)


def _applied(opt_state):
  """Updates that reached the inner optimizer: every update but the skipped ones."""
  m = optax_dls.metrics(opt_state)
  return int(m["num_steps"] - m["skip_count"])


def _tx():
  return optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=S0)


def test_import_optax_dls_does_not_import_flax_or_orbax():
  code = (
    "import sys, optax_dls; "
    "assert not [m for m in sys.modules if m.split('.')[0] in ('flax', 'orbax')]"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


# --- linen ----------------------------------------------------------------------------------


def _linen_setup():
  model = nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)
  params = model.init(jax.random.key(0), X)["params"]
  return model, train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_tx())


def _linen_loss(params, apply_fn, x):
  pred = apply_fn({"params": params}, x).astype(jnp.float32)
  loss = jnp.mean((pred - Y) ** 2)
  return loss, pred


@jax.jit
def _linen_step(state, x):
  grad_fn = dls_flax.value_and_grad(_linen_loss, state, has_aux=True)
  (loss, pred), grads = grad_fn(state.params, state.apply_fn, x)
  return state.apply_gradients(grads=grads), loss, pred, grads


def test_linen_loss_unscaled_grads_scaled_and_update_matches_plain_sgd():
  model, state = _linen_setup()
  new, loss, pred, grads = _linen_step(state, X)
  (ref_loss, ref_pred), ref_grads = jax.jit(
    jax.value_and_grad(_linen_loss, has_aux=True), static_argnums=1
  )(state.params, model.apply, X)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(pred, ref_pred, rtol=1e-6)
  jax.tree.map(
    lambda g, r: np.testing.assert_allclose(g / S0, r, rtol=2e-3, atol=1e-6), grads, ref_grads
  )
  expected = jax.tree.map(lambda p, g: p - 0.1 * g / S0, state.params, grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new.params, expected)
  assert int(new.step) == 1 and _applied(new.opt_state) == 1


@jax.jit
def _linen_fused_step(state, x):
  grad_fn = dls_flax.value_and_grad(_linen_loss, state, has_aux=True)
  _, grads = grad_fn(state.params, state.apply_fn, x)
  return dls_flax.apply_gradients(state, grads=grads)


def test_linen_fused_apply_gradients_matches_the_method_and_keeps_params_on_skip():
  _, ref = _linen_setup()
  fused = ref
  for x in (X, X, X_BAD, X):
    before = fused.params
    ref = _linen_step(ref, x)[0]
    fused = _linen_fused_step(fused, x)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), fused.params, ref.params
    )
    if x is X_BAD:  # skipped: the params come back bit for bit
      jax.tree.map(np.testing.assert_array_equal, fused.params, before)
  assert int(fused.step) == int(ref.step) == 4
  assert _applied(fused) == 3
  assert float(optax_dls.loss_scale(fused)) == float(optax_dls.loss_scale(ref)) == S0 / 2


def test_linen_fused_apply_gradients_keeps_overwrite_with_gradient_and_kwargs():
  params = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"amax": jnp.zeros(3)}}
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=_tx())
  grads = {"params": {"w": jnp.full(2, S0)}, "_overwrite_with_gradient": {"amax": jnp.arange(3.0)}}
  new = dls_flax.apply_gradients(state, grads=grads, apply_fn=len)
  np.testing.assert_allclose(new.params["params"]["w"], 0.9, rtol=1e-6)
  np.testing.assert_array_equal(new.params["_overwrite_with_gradient"]["amax"], jnp.arange(3.0))
  assert new.apply_fn is len
  with pytest.raises(TypeError, match="state must be a flax TrainState"):
    dls_flax.apply_gradients({"params": 1}, grads={})


def test_linen_skipped_step_counts_in_step_not_in_the_applied_updates():
  _, state = _linen_setup()
  state, *_ = _linen_step(state, X)
  skipped, loss, _, _ = _linen_step(state, X_BAD)
  assert not np.isfinite(loss)
  jax.tree.map(np.testing.assert_array_equal, skipped.params, state.params)
  m = optax_dls.metrics(skipped)
  assert bool(m["skipped"]) and float(m["loss_scale"]) == S0 / 2
  assert int(skipped.step) == 2
  assert _applied(skipped) == 1 == int(m["num_steps"] - m["skip_count"])


# --- nnx ------------------------------------------------------------------------------------


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(2, 1, dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
    self.calls = nnx.BatchStat(jnp.zeros([], jnp.int32))  # not differentiated

  def __call__(self, x):
    return self.dense(x).astype(jnp.float32)


def _nnx_loss(model, x):
  return jnp.mean((model(x) - Y) ** 2)


@nnx.jit
def _nnx_step(model, optimizer, x):
  loss, grads = dls_flax.value_and_grad(_nnx_loss, optimizer)(model, x)
  optimizer.update(model, grads)
  return loss, grads


def test_nnx_optimizer_update_unscales_and_skips():
  model = _Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  before = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  loss, grads = _nnx_step(model, optimizer, X)
  ref_grads = nnx.grad(_nnx_loss)(_Net(nnx.Rngs(0)), X)
  assert set(nnx.to_pure_dict(grads)) == {"dense"}  # only nnx.Param (optimizer.wrt)
  np.testing.assert_allclose(loss, _nnx_loss(_Net(nnx.Rngs(0)), X), rtol=1e-6)
  jax.tree.map(
    lambda g, r: np.testing.assert_allclose(g / S0, r, rtol=2e-3, atol=1e-6),
    nnx.to_pure_dict(grads),
    nnx.to_pure_dict(ref_grads),
  )
  after = nnx.state(model, nnx.Param)
  jax.tree.map(
    lambda a, b, g: np.testing.assert_allclose(a, b - 0.1 * g / S0, rtol=1e-6),
    nnx.to_pure_dict(after),
    before,
    nnx.to_pure_dict(grads),
  )

  kept = jax.tree.map(jnp.copy, nnx.to_pure_dict(after))
  loss, _ = _nnx_step(model, optimizer, X_BAD)
  assert not np.isfinite(loss)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.Param)), kept)
  assert int(optimizer.step[...]) == 2
  assert _applied(optimizer) == 1
  m = optax_dls.metrics(optimizer.opt_state)
  assert bool(m["skipped"]) and float(m["loss_scale"]) == S0 / 2
  assert isinstance(m["loss_scale"], jax.Array)


def test_nnx_reset_scale_keeps_variables():
  model = _Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  optimizer.opt_state = optax_dls.reset_scale(optimizer.opt_state, 8.0)
  assert float(optax_dls.loss_scale(optimizer)) == 8.0
  _nnx_step(model, optimizer, X)
  assert _applied(optimizer) == 1


def test_value_and_grad_argument_errors():
  _, state = _linen_setup()
  with pytest.raises(ValueError, match="LossScaleState"):
    dls_flax.value_and_grad(_linen_loss, optax.sgd(0.1).init(state.params))
  with pytest.raises(TypeError, match="has_aux"):
    dls_flax.value_and_grad(_linen_loss, state, has_aux=1)
  with pytest.raises(TypeError, match="argnums"):
    dls_flax.value_and_grad(_linen_loss, state, argnums="0")
  with pytest.raises(TypeError, match="fun"):
    dls_flax.value_and_grad(None, state)


# --- recomputing an overflowing step (max_tries) -----------------------------------------------

Y_BIG = (
  Y * 1e3
)  # a float16 output cotangent of about 1e3 S: it overflows at S0, fits a few halvings below


def _fit(params, apply_fn, x, y):
  pred = apply_fn({"params": params}, x).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def _linen_fit_step(max_tries):
  """A linen step; with ``max_tries`` the call also returns the state to apply the gradients to."""

  @jax.jit
  def step(state, x, y):
    if max_tries is None:
      loss, grads = dls_flax.value_and_grad(_fit, state)(state.params, state.apply_fn, x, y)
    else:
      (loss, grads), state = dls_flax.value_and_grad(_fit, state, max_tries=max_tries)(
        state.params, state.apply_fn, x, y
      )
    return state.apply_gradients(grads=grads), loss

  return step


def test_linen_recompute_applies_every_batch_and_compiles_once():
  step, plain_step = _linen_fit_step(8), _linen_fit_step(None)
  _, state = _linen_setup()
  state = state.replace(
    step=jnp.zeros([], jnp.int32)
  )  # TrainState.create's Python int would retrace once
  plain = state
  for y in (Y, Y_BIG, Y, Y_BIG):
    before = state.params
    state, loss = step(state, X, y)
    plain, _ = plain_step(plain, X, y)
    assert np.isfinite(loss) and not np.array_equal(state.params["kernel"], before["kernel"])
  m = optax_dls.metrics(state)
  assert int(m["skip_count"]) == 0 and _applied(state) == 4 == int(state.step)
  assert int(optax_dls.metrics(plain)["skip_count"]) >= 1  # without recomputing, a batch is lost
  assert int(m["recomputed_steps"]) >= 1 and int(m["recompute_tries"]) >= int(m["recomputed_steps"])
  assert float(m["loss_scale"]) == S0 / 2 ** int(m["recompute_tries"])  # each try backed S off
  assert step._cache_size() == 1


def test_linen_recomputed_step_equals_a_step_run_directly_at_the_final_scale():
  _, state = _linen_setup()
  new, loss = _linen_fit_step(8)(state, X, Y_BIG)
  final = float(optax_dls.loss_scale(new))
  assert final < S0 and int(optax_dls.metrics(new)["recompute_tries"]) >= 1
  direct = state.replace(opt_state=optax_dls.reset_scale(state.opt_state, final))
  new_d, loss_d = _linen_fit_step(None)(direct, X, Y_BIG)
  assert float(loss) == float(loss_d)
  # Powers of two: the gradients are the same bit for bit (tests/test_recompute.py). The two
  # steps are different compiled programs, and XLA may contract the optimizer's arithmetic
  # differently in each: the parameters agree to float32 rounding.
  same = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-7, atol=0)
  jax.tree.map(same, new.params, new_d.params)


def test_linen_float32_last_resort_when_every_float16_try_overflows():
  model32 = nn.Dense(1)  # the same parameters, computed in float32
  fit32 = lambda params, apply_fn, x, y: _fit(params, model32.apply, x, y)
  _, state = _linen_setup()

  @jax.jit
  def step(state, x, y):
    grad_fn = dls_flax.value_and_grad(_fit, state, max_tries=1, fp32_fun=fit32)
    (loss, grads), state = grad_fn(state.params, state.apply_fn, x, y)
    return state.apply_gradients(grads=grads), loss, grads

  # Float16 overflows at S0 and at S0 / 2: the float32 pass runs, at S0 / 4 (after both backoffs).
  new, loss, grads = step(state, X, Y_BIG)
  m = optax_dls.metrics(new)
  assert int(m["skip_count"]) == 0 and int(m["recompute_tries"]) == 2 and _applied(new) == 1
  assert float(m["loss_scale"]) == S0 / 4
  np.testing.assert_allclose(
    loss, fit32(state.params, None, X, Y_BIG), rtol=1e-6
  )  # the float32 loss
  expected = jax.grad(lambda p: _fit(p, model32.apply, X, Y_BIG) * S0 / 4)(state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, expected)


class _NormNet(nnx.Module):
  """BatchNorm and Dropout before a float16 layer: the loss updates statistics and an RNG count."""

  def __init__(self, rngs):
    self.norm = nnx.BatchNorm(2, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.dense = nnx.Linear(2, 1, dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.dense(self.drop(self.norm(x))).astype(jnp.float32)


def _nnx_fit(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _nnx_setup():
  model = _NormNet(nnx.Rngs(0, dropout=1))
  tx = optax_dls.dynamic_loss_scale(
    optax.sgd(1e-4), init_scale=S0
  )  # small steps: Y_BIG does not diverge
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _nnx_fit_step(max_tries):
  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = dls_flax.value_and_grad(_nnx_fit, optimizer, max_tries=max_tries)(model, x, y)
    optimizer.update(model, grads)
    return loss, grads

  return step


def _module_state(model):
  """Every variable of ``model`` as plain arrays (RNG keys as their key data)."""
  unkey = lambda x: (
    jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.copy(x)
  )
  return jax.tree.map(unkey, nnx.to_pure_dict(nnx.state(model)))


def test_nnx_recompute_applies_every_batch_and_compiles_once():
  step, plain_step = _nnx_fit_step(8), _nnx_fit_step(None)
  model, optimizer = _nnx_setup()
  plain_model, plain_opt = _nnx_setup()
  for y in (Y, Y_BIG, Y, Y_BIG):
    before = _module_state(model)["dense"]["kernel"]
    loss, _ = step(model, optimizer, X, y)
    plain_step(plain_model, plain_opt, X, y)
    assert np.isfinite(loss) and not np.array_equal(model.dense.kernel[...], before)
  m = optax_dls.metrics(optimizer)
  assert int(m["skip_count"]) == 0 and _applied(optimizer) == 4
  assert int(optax_dls.metrics(plain_opt)["skip_count"]) >= 1
  assert int(m["recomputed_steps"]) >= 1 and float(m["loss_scale"]) == S0 / 2 ** int(
    m["recompute_tries"]
  )
  assert int(model.drop.rngs.count[...]) == 4  # one pass per step advanced the RNG
  assert step.jitted_fn._cache_size() == 1


def test_nnx_recomputed_step_equals_a_step_run_directly_at_the_final_scale():
  model, optimizer = _nnx_setup()
  loss, grads = _nnx_fit_step(8)(model, optimizer, X, Y_BIG)
  final = float(optax_dls.loss_scale(optimizer))
  assert final < S0 and int(optax_dls.metrics(optimizer)["recompute_tries"]) >= 1
  direct_model, direct_opt = _nnx_setup()
  direct_opt.opt_state = optax_dls.reset_scale(direct_opt.opt_state, final)
  loss_d, grads_d = _nnx_fit_step(None)(direct_model, direct_opt, X, Y_BIG)
  assert float(loss) == float(loss_d)
  # Same gradients (the structure optimizer.update expects), parameters, batch statistics and RNG
  # state: the failed tries left nothing behind in the module.
  assert jax.tree.structure(grads) == jax.tree.structure(grads_d)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(grads), nnx.to_pure_dict(grads_d))
  jax.tree.map(np.testing.assert_array_equal, _module_state(model), _module_state(direct_model))
  assert float(optax_dls.metrics(optimizer)["num_steps"]) == 1


def test_nnx_recompute_with_argnums_tuple_and_aux():
  model, optimizer = _nnx_setup()

  def fit(model, y, x):
    return _nnx_fit(model, x, y), {"n": x.shape[0]}

  @nnx.jit
  def grads_of(model, optimizer, y):
    return dls_flax.value_and_grad(fit, optimizer, argnums=(0, 1), has_aux=True, max_tries=4)(
      model, y, X
    )

  (loss, aux), (g_model, g_y) = grads_of(model, optimizer, Y_BIG)
  assert aux == {"n": 2} and np.isfinite(loss) and g_y.shape == Y.shape
  ref = nnx.grad(lambda m, y: fit(m, y, X)[0], argnums=(nnx.DiffState(0, nnx.Param), 1))(
    _nnx_setup()[0], Y_BIG
  )
  assert jax.tree.structure(g_model) == jax.tree.structure(ref[0])
  assert int(optax_dls.metrics(optimizer)["recomputed_steps"]) == 1


def test_recompute_argument_errors():
  _, state = _linen_setup()
  with pytest.raises(ValueError, match="fp32_fun.*max_tries"):
    dls_flax.value_and_grad(_fit, state, fp32_fun=_fit)
  with pytest.raises(TypeError, match="fp32_fun"):
    dls_flax.value_and_grad(_fit, state, max_tries=2, fp32_fun=1)
  with pytest.raises(ValueError, match="max_tries"):
    dls_flax.value_and_grad(_fit, state, max_tries=65)
  with pytest.raises(TypeError, match="max_tries"):
    dls_flax.value_and_grad(_fit, state, max_tries=1.5)
  with pytest.raises(TypeError, match="opt must be a flax TrainState or an nnx.Optimizer"):
    dls_flax.value_and_grad(_fit, state.opt_state, max_tries=2)
  for not_an_optimizer in ("x", None, {}, 3, state.tx):
    with pytest.raises(TypeError, match="opt must be a flax TrainState or an nnx.Optimizer"):
      dls_flax.value_and_grad(_fit, not_an_optimizer, max_tries=2)
  chained = state.replace(tx=optax.chain(state.tx), opt_state=(state.opt_state,))
  with pytest.raises(TypeError, match="opt.tx must be the loss-scaled transformation"):
    dls_flax.value_and_grad(_fit, chained, max_tries=2)
  grad_fn = dls_flax.value_and_grad(_fit, state, argnums=4, max_tries=2)
  with pytest.raises(TypeError, match="argnums=4"):
    grad_fn(state.params, state.apply_fn, X, Y)


# --- examples -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flax_linen", "flax_nnx"])
def test_example_smoke(name, capsys, monkeypatch):
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)  # linen modules are dataclasses
  spec.loader.exec_module(module)
  out = module.main(["--steps", "4", "--log-every", "2"])
  assert out["steps"] == 4 and np.isfinite(out["loss"])
  assert out["skip_count"] >= 1 and out["loss_scale"] < 2.0**24  # 2**24 overflows fp16 first
  assert "loss scale" in capsys.readouterr().out


def test_has_aux_with_a_scalar_loss_names_the_problem():
  opt_state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
  grad_fn = dls_flax.value_and_grad(lambda p: jnp.sum(p["w"]), opt_state, has_aux=True)
  with pytest.raises(TypeError, match=r"has_aux=True.*\(loss, aux\)"):
    grad_fn({"w": jnp.ones(2)})
