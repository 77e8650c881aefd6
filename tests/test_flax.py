"""optax_dls.flax: loss-scaled value_and_grad with linen TrainState and nnx.Optimizer."""

import functools
import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import jit_xla_defaults
from flax import linen as nn
from flax import nnx
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state
from jax.sharding import PartitionSpec as P

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


def _tx(inner=None):
  inner = optax.sgd(0.1) if inner is None else inner
  return optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.recompute_stats(), inner), init_scale=S0
  )


def test_import_optax_dls_does_not_import_flax_or_orbax():
  code = (
    "import sys, optax_dls; "
    "assert not [m for m in sys.modules if m.split('.')[0] in ('flax', 'orbax')]"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


# --- linen ------------------------------------------------------------------------------------


def _linen_setup():
  model = nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)
  params = model.init(jax.random.key(0), X)["params"]
  return model, train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_tx())


def _linen_loss(params, apply_fn, x):
  pred = apply_fn({"params": params}, x).astype(jnp.float32)
  loss = jnp.mean((pred - Y) ** 2)
  return loss, pred


_linen_grad_fn = dls_flax.value_and_grad(_linen_loss, has_aux=True)  # built once, anywhere


@jax.jit
def _linen_step(state, x):
  ((loss, pred), grads), state = _linen_grad_fn(state, state.params, state.apply_fn, x)
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


# --- nnx --------------------------------------------------------------------------------------


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
  (loss, grads), optimizer = dls_flax.value_and_grad(_nnx_loss)(optimizer, model, x)
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
  assert float(optax_dls.find_state(optimizer).loss_scale) == 8.0
  _nnx_step(model, optimizer, X)
  assert _applied(optimizer) == 1


def test_value_and_grad_argument_errors():
  _, state = _linen_setup()
  with pytest.raises(TypeError, match="has_aux"):
    dls_flax.value_and_grad(_linen_loss, has_aux=1)
  with pytest.raises(TypeError, match="argnums"):
    dls_flax.value_and_grad(_linen_loss, argnums="0")
  with pytest.raises(TypeError, match="fun"):
    dls_flax.value_and_grad(None)
  with pytest.raises(TypeError, match="axis_name"):
    dls_flax.value_and_grad(_linen_loss, axis_name=3)
  plain = state.replace(opt_state=optax.sgd(0.1).init(state.params), tx=optax.sgd(0.1))
  with pytest.raises(
    TypeError, match="state.tx must be a loss-scaled transformation.*wrap the optimizer"
  ):
    dls_flax.value_and_grad(_linen_loss)(plain, state.params, state.apply_fn, X)


def test_the_state_passed_when_building_says_it_now_goes_to_grad_fn():
  _, state = _linen_setup()
  with pytest.raises(
    TypeError, match=r"takes the TrainState or nnx.Optimizer when called.*got 1 more .*TrainState"
  ):
    dls_flax.value_and_grad(_linen_loss, state)


def test_swapped_arguments_are_named():
  _, state = _linen_setup()
  grad_fn = dls_flax.value_and_grad(_linen_loss, has_aux=True)
  with pytest.raises(
    TypeError,
    match=r"grad_fn takes the flax TrainState or nnx.Optimizer first .*grad_fn\(state, \*args\)"
    r".*got a dict\. The third argument is one: the arguments look swapped",
  ):
    grad_fn(state.params, state.apply_fn, state, X)
  model = _Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  with pytest.raises(TypeError, match=r"got a _Net\. The second argument is one"):
    dls_flax.value_and_grad(_nnx_loss)(model, optimizer, X)


# --- recomputing an overflowing step (max_tries) ----------------------------------------------

Y_BIG = (
  Y * 1e3
)  # a float16 output cotangent of about 1e3 S: it overflows at S0, fits a few halvings below


def _fit(params, apply_fn, x, y):
  pred = apply_fn({"params": params}, x).astype(jnp.float32)
  return jnp.mean((pred - y) ** 2)


def _linen_fit_step(max_tries):
  """A linen step; with ``max_tries`` the call also returns the state to apply the gradients to."""

  grad_fn = dls_flax.value_and_grad(_fit, max_tries=max_tries)

  @jax.jit
  def step(state, x, y):
    (loss, grads), state = grad_fn(state, state.params, state.apply_fn, x, y)
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
  final = float(optax_dls.find_state(new).loss_scale)
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
    grad_fn = dls_flax.value_and_grad(_fit, max_tries=1, fp32_fun=fit32)
    (loss, grads), state = grad_fn(state, state.params, state.apply_fn, x, y)
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
  tx = _tx(optax.sgd(1e-4))  # small steps: Y_BIG does not diverge
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _nnx_fit_step(max_tries):
  @nnx.jit
  def step(model, optimizer, x, y):
    grad_fn = dls_flax.value_and_grad(_nnx_fit, max_tries=max_tries)
    (loss, grads), optimizer = grad_fn(optimizer, model, x, y)
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
  final = float(optax_dls.find_state(optimizer).loss_scale)
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
    grad_fn = dls_flax.value_and_grad(fit, argnums=(0, 1), has_aux=True, max_tries=4)
    return grad_fn(optimizer, model, y, X)[0]

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
    dls_flax.value_and_grad(_fit, fp32_fun=_fit)
  with pytest.raises(TypeError, match="fp32_fun"):
    dls_flax.value_and_grad(_fit, max_tries=2, fp32_fun=1)
  with pytest.raises(ValueError, match="max_tries"):
    dls_flax.value_and_grad(_fit, max_tries=65)
  with pytest.raises(TypeError, match="max_tries"):
    dls_flax.value_and_grad(_fit, max_tries=1.5)
  grad_fn = dls_flax.value_and_grad(_fit, max_tries=2)
  for not_a_state in ("x", None, {}, 3, state.tx, state.opt_state):
    with pytest.raises(TypeError, match="grad_fn takes the flax TrainState or nnx.Optimizer"):
      grad_fn(not_a_state, state.params, state.apply_fn, X, Y)
  chained = state.replace(tx=optax.chain(state.tx), opt_state=(state.opt_state,))
  with pytest.raises(
    TypeError, match="state.tx must be a loss-scaled transformation.*wrap the optimizer"
  ):
    grad_fn(chained, state.params, state.apply_fn, X, Y)
  grad_fn = dls_flax.value_and_grad(_fit, argnums=4, max_tries=2)
  with pytest.raises(TypeError, match=r"argnums=4 .* grad_fn\(state, \*args\)"):
    grad_fn(state, state.params, state.apply_fn, X, Y)


# --- examples ---------------------------------------------------------------------------------


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
  _, state = _linen_setup()
  grad_fn = dls_flax.value_and_grad(lambda p: jnp.sum(p["kernel"]), has_aux=True)
  with pytest.raises(TypeError, match=r"has_aux=True.*\(loss, aux\)"):
    grad_fn(state, state.params)


# --- a skipped step leaves the model's other state as it was ----------------------------------


class _BNNet(nn.Module):
  """BatchNorm then a float16 dense layer: an inf input makes the batch statistics NaN."""

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x).astype(jnp.float32)


class _BNState(train_state.TrainState):
  batch_stats: dict


def _bn_setup():
  model = _BNNet()
  variables = model.init(jax.random.key(0), X)
  return _BNState.create(
    apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=_tx()
  )


def _bn_loss(params, state, x):
  pred, updates = state.apply_fn(
    {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
  )
  return jnp.mean((pred - Y) ** 2), updates["batch_stats"]


@pytest.mark.parametrize("max_tries", [None, 2])
def test_linen_batch_stats_kept_on_a_skipped_step_as_documented(max_tries):
  """flax value_and_grad docstring: the old batch_stats kept where metrics says skipped."""
  grad_fn = dls_flax.value_and_grad(_bn_loss, has_aux=True, max_tries=max_tries)

  @jax.jit
  def step(state, x):
    ((_, batch_stats), grads), state = grad_fn(state, state.params, state, x)
    new = state.apply_gradients(grads=grads)
    skipped = optax_dls.metrics(new.opt_state)["skipped"]
    keep = lambda n, o: jnp.where(skipped, o, n)
    new = new.replace(batch_stats=jax.tree.map(keep, batch_stats, state.batch_stats))
    return new, batch_stats

  state = _bn_setup()
  state, stats = step(state, X)
  assert bool(optax_dls.metrics(state)["skipped"]) is False
  jax.tree.map(np.testing.assert_array_equal, state.batch_stats, stats)  # applied: the new ones
  before = jax.tree.map(jnp.copy, state.batch_stats)
  skipped, stats = step(state, X_BAD)  # the forward pass overflows: NaN statistics
  assert bool(optax_dls.metrics(skipped)["skipped"])
  assert not all(np.isfinite(s).all() for s in jax.tree.leaves(stats))
  jax.tree.map(np.testing.assert_array_equal, skipped.batch_stats, before)
  assert int(skipped.step) == 2


@pytest.mark.parametrize("max_tries", [None, 2])
def test_nnx_batch_stats_are_kept_on_a_skipped_step(max_tries):
  model = _NormNet(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, _tx(optax.sgd(1e-3)), wrt=nnx.Param)
  grad_fn = dls_flax.value_and_grad(_nnx_fit, max_tries=max_tries)

  @nnx.jit
  def step(model, optimizer, x):
    (loss, grads), optimizer = grad_fn(optimizer, model, x, Y)
    optimizer.update(model, grads)
    return loss

  step(model, optimizer, X)
  stats = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
  assert not np.array_equal(stats["norm"]["mean"], np.zeros(2))  # the applied step moved them
  count = int(model.drop.rngs.count[...])
  loss = step(model, optimizer, X_BAD)
  assert not np.isfinite(loss) and bool(optax_dls.metrics(optimizer)["skipped"])
  jax.tree.map(
    np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), stats
  )
  assert int(model.drop.rngs.count[...]) == count + 1  # the RNG stream advances as step does


# --- calling convention -----------------------------------------------------------------------


def test_linen_without_max_tries_hands_back_an_equal_state_for_a_finite_loss():
  _, state = _linen_setup()
  (_, _), same = dls_flax.value_and_grad(_linen_loss, has_aux=True)(
    state, state.params, state.apply_fn, X
  )
  assert jax.tree.structure(same) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, same, state)


def test_fun_may_take_a_keyword_named_scale():
  _, state = _linen_setup()

  def loss(params, apply_fn, x, *, scale, state):
    return _linen_loss(params, apply_fn, x)[0] * scale + state

  for max_tries in (None, 2):
    grad_fn = dls_flax.value_and_grad(loss, max_tries=max_tries)
    (value, _), _ = grad_fn(state, state.params, state.apply_fn, X, scale=0.5, state=1.0)
    np.testing.assert_allclose(value, _linen_loss(state.params, state.apply_fn, X)[0] * 0.5 + 1.0)


# --- several devices (axis_name) --------------------------------------------------------------


def _sharded_linen_step(axis_name, tx_axis_name=None, max_tries=None):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  tx = optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.recompute_stats(), optax.sgd(0.1)),
    init_scale=S0,
    axis_name=tx_axis_name,
  )
  model = nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)
  params = model.init(jax.random.key(0), X)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  grad_fn = dls_flax.value_and_grad(_fit, axis_name=axis_name, max_tries=max_tries)

  def local(state, x, y):
    (_, grads), state = grad_fn(state, state.params, state.apply_fn, x, y)
    return jax.tree.map(lambda g: g[None], grads), optax_dls.find_state(state).loss_scale[None]

  spec = jax.tree.map(lambda _: P(), state)
  f = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(spec, P("data"), P("data")),
    out_specs=(P("data"), P("data")),
    check_vma=False,
  )
  return jax.jit(f), state


def test_axis_name_averages_the_gradients_over_devices():
  x = jnp.linspace(-1.0, 1.0, 16).reshape(8, 2)
  y = jnp.linspace(0.0, 1.0, 8).reshape(8, 1)
  f, state = _sharded_linen_step("data")
  grads, _ = f(state, x, y)

  def on_device(i):  # device i's gradients alone: its row of x and y
    return jax.grad(lambda p: _fit(p, state.apply_fn, x[i : i + 1], y[i : i + 1]) * S0)(
      state.params
    )

  mean = jax.tree.map(lambda *g: sum(g) / 8, *[on_device(i) for i in range(8)])
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(mean)):
    for d in range(8):  # the same average on every device
      np.testing.assert_allclose(got[d], want, rtol=2e-3, atol=1e-6)
  f, state = _sharded_linen_step(None)
  grads, _ = f(state, x, y)
  assert not np.allclose(grads["kernel"][0], grads["kernel"][1])  # without it, each its own


def test_axis_name_makes_every_device_retry_alike():
  x = jnp.ones((8, 2)).at[3].set(1e3)  # device 3's gradients overflow at S0
  f, state = _sharded_linen_step("data", max_tries=4)  # the transformation without axis_name
  _, scales = f(state, x, jnp.zeros((8, 1)))
  assert len(set(np.asarray(scales).tolist())) == 1 and float(scales[0]) < S0


# --- passthrough: bit for bit a plain step ----------------------------------------------------


class _ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Conv(4, (3, 3), strides=2)(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_no_loss_scale_through_the_flax_helper_is_a_plain_loop_to_rounding():
  model = _ConvNet()
  images = jax.random.normal(jax.random.key(1), (5, 4, 8, 8, 3))
  labels = jax.random.randint(jax.random.key(2), (5, 4), 0, 3)
  variables = model.init(jax.random.key(0), images[0])

  def loss_fn(params, batch_stats, x, y):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]

  def run(tx, grads_of):
    state = _BNState.create(
      apply_fn=model.apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=tx,
    )
    step = jit_xla_defaults(grads_of)  # as a user's program is compiled
    for x, y in zip(images, labels):
      state = step(state, x, y)
    return state

  def plain(state, x, y):
    (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params, state.batch_stats, x, y
    )
    return state.apply_gradients(grads=grads, batch_stats=stats)

  grad_fn = dls_flax.value_and_grad(loss_fn, has_aux=True)

  def ours(state, x, y):
    ((_, stats), grads), state = grad_fn(state, state.params, state.batch_stats, x, y)
    return state.apply_gradients(grads=grads, batch_stats=stats)

  # SGD: Adam's normalisation would turn a last-bit difference of a gradient near 0
  # (XLA may contract the two programs' arithmetic differently) into a step of lr.
  ref = run(optax.sgd(1e-2, momentum=0.9), plain)
  got = run(optax_dls.no_loss_scale(optax.sgd(1e-2, momentum=0.9)), ours)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  jax.tree.map(close, got.params, ref.params)
  jax.tree.map(close, got.batch_stats, ref.batch_stats)
  # A scale restored from a scaled run multiplies the loss once (the update divides it out).
  forged = got.replace(opt_state=got.opt_state._replace(loss_scale=jnp.float32(8.0)))
  (_, grads), _ = grad_fn(forged, got.params, got.batch_stats, images[0], labels[0])
  (_, expected) = jax.value_and_grad(loss_fn, has_aux=True)(
    got.params, got.batch_stats, images[0], labels[0]
  )
  jax.tree.map(lambda g, e: np.testing.assert_array_equal(g, 8 * e), grads, expected)


# --- the port from flax's DynamicScale --------------------------------------------------------


def _ds_step(ds, bad):
  """One step of flax's DynamicScale on a loss whose gradient is inf when ``bad``."""
  loss = lambda p: jnp.sum(p**2) * jnp.where(bad, jnp.inf, 1.0)
  return ds.value_and_grad(loss)(jnp.ones(2)).dynamic_scale


def test_from_dynamic_scale_continues_flax_growth_timing_exactly():
  pattern = [False, False, True, False, False, False, False, False, True] + [False] * 12
  interval = 3
  ds = flax_dynamic_scale.DynamicScale(growth_interval=interval, scale=2.0**10)
  for bad in pattern[:6]:
    ds = _ds_step(ds, bad)
  assert int(ds.fin_steps) == 3  # mid-way to a growth: the count must carry over
  tx = optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.config.preset("flax", growth_interval=interval, scale=2.0**10)
  )
  state = dls_flax.from_dynamic_scale(ds, tx.init({"w": jnp.ones(2)}))
  assert float(state.loss_scale) == float(ds.scale)
  for bad in pattern[6:]:
    ds = _ds_step(ds, bad)
    grads = {"w": jnp.where(bad, jnp.inf, 1.0) * jnp.ones(2) * state.loss_scale}
    _, state = tx.update(grads, state)
    assert float(state.loss_scale) == float(ds.scale)
  assert float(ds.scale) > 2.0**10  # it grew on the way


def test_from_dynamic_scale_takes_the_stored_dict_and_checks_it():
  _, state = _linen_setup()
  new = dls_flax.from_dynamic_scale({"scale": np.float64(256.0), "fin_steps": 5}, state)
  st = optax_dls.find_state(new)
  assert float(st.loss_scale) == 256.0 and int(st.policy_state.growth_tracker) == 5
  assert st.loss_scale.dtype == jnp.float32 and st.policy_state.growth_tracker.dtype == jnp.int32
  assert isinstance(new, train_state.TrainState)
  with pytest.raises(TypeError, match="source must be a flax DynamicScale"):
    dls_flax.from_dynamic_scale({"scale": 2.0}, state)
  with pytest.raises(ValueError, match="dynamic_scale.scale"):
    dls_flax.from_dynamic_scale({"scale": 0.0, "fin_steps": 0}, state)  # not a valid scale
  with pytest.raises(ValueError, match="dynamic_scale.fin_steps"):
    dls_flax.from_dynamic_scale({"scale": 2.0, "fin_steps": -1}, state)


def test_a_train_state_of_a_plain_optimizer_is_told_to_wrap_it():
  model, state = _linen_setup()
  plain = train_state.TrainState.create(
    apply_fn=model.apply, params=state.params, tx=optax.adam(0.1)
  )
  with pytest.raises(TypeError, match=r"wrap the optimizer with optax_dls.dynamic_loss_scale"):
    _linen_grad_fn(plain, plain.params, plain.apply_fn, X)


def test_optax_dls_flax_is_reachable_without_importing_it():
  code = "import optax_dls; print(optax_dls.flax.value_and_grad.__name__)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "value_and_grad"
  with pytest.raises(AttributeError, match="module 'optax_dls' has no attribute 'flaxx'"):
    optax_dls.flaxx  # noqa: B018


def test_linen_value_and_grad_keeps_the_calling_convention_of_fun():
  """A string and a Python flag among the arguments (positional, keyword, or static under
  jit) and a string in aux come back as jax.value_and_grad gives them."""
  _, state = _linen_setup()

  def loss(params, apply_fn, x, mode, *, negate=False):
    value, pred = _linen_loss(params, apply_fn, x)
    return (-value if negate else value), {"mode": mode, "n": 3, "pred": pred}

  grad_fn = dls_flax.value_and_grad(loss, has_aux=True)
  ((value, aux), grads), _ = grad_fn(state, state.params, state.apply_fn, X, "eval", negate=True)
  (ref, ref_aux), ref_grads = jax.value_and_grad(loss, has_aux=True)(
    state.params, state.apply_fn, X, "eval", negate=True
  )
  assert aux["mode"] == "eval" and aux["n"] == 3
  np.testing.assert_allclose(value, ref, rtol=1e-6)
  np.testing.assert_allclose(aux["pred"], ref_aux["pred"], rtol=1e-6)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g / S0, r, rtol=1e-3), grads, ref_grads)

  @functools.partial(jax.jit, static_argnums=(1, 2, 3))
  def step(state, apply_fn, mode, negate):
    ((value, aux), grads), state = grad_fn(state, state.params, apply_fn, X, mode, negate=negate)
    return value, aux["n"], state.apply_gradients(grads=grads)

  value, n, after = step(state, state.apply_fn, "train", True)
  np.testing.assert_allclose(value, ref, rtol=1e-6)
  assert int(n) == 3 and _applied(after.opt_state) == 1


def test_nnx_value_and_grad_keeps_the_calling_convention_of_fun():
  """With an nnx.Optimizer too: a string and a keyword flag reach fun, a string comes back
  in aux, with retries."""
  model, optimizer = _nnx_setup()

  def fit(model, x, y, mode, *, double=False):
    return _nnx_fit(model, x, y) * (2.0 if double else 1.0), {"mode": mode}

  grad_fn = dls_flax.value_and_grad(fit, has_aux=True, max_tries=2)
  ((loss, aux), _), _ = grad_fn(optimizer, model, X, Y, "eval", double=True)
  ref = 2.0 * _nnx_fit(_nnx_setup()[0], X, Y)
  assert aux == {"mode": "eval"}
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
