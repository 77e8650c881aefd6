"""An Equinox model, its activation functions among its leaves, through update,
apply_step, value_and_grad, init and the leaf names."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step

import optax_dls
from optax_dls._access.names import leaf_names

eqx = pytest.importorskip("equinox")


def _model():
  return eqx.nn.MLP(2, 2, 3, 1, key=jax.random.key(0))


def _loss(model, x):
  return jnp.mean(jax.vmap(model)(x) ** 2)


def _tx():
  return optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**15)


def test_model_with_functions_trains_through_value_and_grad_update_and_apply_step():
  model, tx, x = _model(), _tx(), jnp.ones((4, 2))
  state = tx.init(eqx.filter(model, eqx.is_array))
  grad_fn = optax_dls.value_and_grad(_loss, tx)

  @eqx.filter_jit
  def step(model, state, x):
    (loss, grads), state = grad_fn(state, model, x)
    updates, _ = tx.update(grads, state, model)
    new_model, state = apply_step(tx, grads, state, model)
    return new_model, state, loss, grads, updates

  new_model, state, _, grads, updates = step(model, state, x)
  # As eqx.filter_value_and_grad: the functions get None, the arrays the unscaled
  # gradients times the scale.
  _, want = eqx.filter_value_and_grad(_loss)(model, x)
  assert grads.activation is None
  np.testing.assert_allclose(
    np.asarray(grads.layers[0].weight), np.asarray(want.layers[0].weight) * 2.0**15, rtol=1e-5
  )
  assert bool(state.last_step_finite)
  assert new_model.activation is model.activation  # passed through
  assert updates.activation is None
  expected = eqx.apply_updates(model, updates)
  np.testing.assert_array_equal(
    np.asarray(new_model.layers[1].bias), np.asarray(expected.layers[1].bias)
  )


def test_skipped_step_leaves_the_model_and_names_the_leaf(tmp_path):
  model, tx = _model(), _tx()
  state = tx.init(eqx.filter(model, eqx.is_array))
  grads = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_array))
  grads = eqx.tree_at(lambda m: m.layers[1].weight, grads, jnp.full((2, 3), jnp.inf))
  new_model, state = apply_step(tx, grads, state, model)
  assert not bool(state.last_step_finite)
  assert eqx.tree_equal(new_model, model)
  assert optax_dls.nonfinite_leaves(state, model) == {"layers/1/weight": "inf"}
  with optax_dls.writers.MetricsWriter(tmp_path, tensorboard=False, params=model) as w:
    w.log(0, optax_dls.metrics(state))
  row = json.loads((tmp_path / optax_dls.writers.JSONL_NAME).read_text().splitlines()[0])
  assert row["nonfinite_leaves"] == {"layers/1/weight": "inf"}
  assert leaf_names(model) == [
    "layers/0/weight",
    "layers/0/bias",
    "layers/1/weight",
    "layers/1/bias",
  ]


def test_init_of_a_whole_model_names_the_fix():
  with pytest.raises(TypeError, match=r"params\.activation: for an Equinox model pass eqx\.filter"):
    _tx().init(_model())


def test_example_trains_in_float16_and_shows_a_skip(capsys, monkeypatch):
  import importlib.util
  import pathlib
  import sys

  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "equinox_digits.py"
  spec = importlib.util.spec_from_file_location("example_equinox_digits", path)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)
  spec.loader.exec_module(module)
  out = module.main(["--steps", "4", "--log-every", "2"])
  assert out["steps"] == 4 and np.isfinite(out["loss"])
  assert out["skip_count"] >= 1 and out["loss_scale"] < 2.0**24  # 2**24 overflows fp16 first
  assert "loss scale" in capsys.readouterr().out


def test_value_and_grad_differentiates_only_floating_arrays_of_a_model_with_dropout():
  """eqx.nn.Dropout holds a Python float and a bool, and a float field is a Python float:
  none of them is differentiated, as with eqx.filter_value_and_grad."""

  class Net(eqx.Module):
    lin: eqx.nn.Linear
    drop: eqx.nn.Dropout
    temp: float = 2.0

    def __call__(self, x):
      return self.drop(self.lin(x), inference=True) / self.temp

  net = Net(eqx.nn.Linear(3, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.1))
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(eqx.filter(net, eqx.is_array))
  loss = lambda m, x: jnp.sum(m(x) ** 2)
  (_, grads), state = optax_dls.value_and_grad(loss, tx)(state, net, jnp.ones(3))
  _, ref_grads = eqx.filter_value_and_grad(loss)(net, jnp.ones(3))
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  assert grads.temp is None and grads.drop.p is None
  np.testing.assert_allclose(grads.lin.weight / 2.0**15, ref_grads.lin.weight, rtol=1e-6)
  new = apply_step(tx, grads, state, net)[0]
  assert new.temp == 2.0 and isinstance(new.temp, float)


class _WithDropout(eqx.Module):
  lin: eqx.nn.Linear
  drop: eqx.nn.Dropout

  def __call__(self, x):
    return self.drop(self.lin(x), inference=True)


def test_a_model_with_python_number_fields_names_only_its_arrays_and_is_refused_by_init():
  """Dropout's p (a float) and inference (a bool) are not parameters: the whole model names
  the leaves its arrays name, so nonfinite_leaves and the writer take it; init refuses it
  as it refuses a model holding a function."""
  model = _WithDropout(eqx.nn.Linear(3, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.1))
  params = eqx.filter(model, eqx.is_array)
  assert leaf_names(model) == leaf_names(params) == ["lin/weight", "lin/bias"]
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init(params)
  bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
  _, state = tx.update(bad, state, params)
  assert optax_dls.nonfinite_leaves(state, model) == {"lin/weight": "inf", "lin/bias": "inf"}
  with pytest.raises(TypeError, match=r"drop.*eqx.filter\(model, eqx.is_array\)"):
    tx.init(model)


class _Indexed(eqx.Module):
  """A model holding an integer array (which outputs to read) beside its weights."""

  lin: eqx.nn.Linear
  idx: jax.Array

  def __call__(self, x):
    return self.lin(x)[self.idx]


@pytest.mark.parametrize("lowering", ["auto", "where", "cond"])
@pytest.mark.parametrize(
  "make",
  [
    lambda low: optax_dls.dynamic_loss_scale(optax.adamw(1e-2), skip_lowering=low),
    lambda low: optax_dls.static_loss_scale(optax.adamw(1e-2), 4.0, skip_lowering=low),
    lambda low: optax_dls.dynamic_loss_scale(
      optax.MultiSteps(optax.adam(1e-2), 1), skip_lowering=low
    ),
    lambda low: optax_dls.no_loss_scale(optax.adamw(1e-2)),
  ],
  ids=["dynamic", "static", "multisteps", "no_loss_scale"],
)
def test_an_integer_array_of_the_model_is_held_out_and_passed_through(make, lowering):
  model = _Indexed(eqx.nn.Linear(3, 4, key=jax.random.key(0)), jnp.array([0, 2], jnp.int32))
  tx, x = make(lowering), jnp.ones(3)
  state = tx.init(eqx.filter(model, eqx.is_array))  # as the Equinox guide builds it

  @eqx.filter_jit
  def steps(model, state, x):
    grads = eqx.filter_grad(lambda m: optax_dls.scale_loss(jnp.sum(m(x)), state))(model)
    assert grads.idx is None
    updates, state1 = tx.update(grads, state, eqx.filter(model, eqx.is_array))
    fused, state2 = apply_step(tx, grads, state, model)
    return eqx.apply_updates(model, updates), state1, fused, state2

  model1, state1, fused, _ = steps(model, state, x)
  for new in (model1, fused):
    assert new.idx.dtype == jnp.int32 and new.idx is not model.idx
    np.testing.assert_array_equal(new.idx, model.idx)
    assert not np.array_equal(new.lin.weight, model.lin.weight)
  np.testing.assert_array_equal(fused.lin.weight, model1.lin.weight)
  assert jax.tree.structure(state1) == jax.tree.structure(state)
  # an overflow skips the step and leaves everything as it was
  if float(state.loss_scale) != 1.0:  # no_loss_scale checks nothing
    skipped, _, fused_skipped, _ = steps(model, state, x * jnp.inf)
    for new in (skipped, fused_skipped):
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_integer_parameter_with_a_gradient_passes_it_through_beside_adam():
  params = {"w": jnp.ones(3), "step": jnp.array([5], jnp.int32)}
  grads = {"w": jnp.full(3, 4.0), "step": jnp.array([2], jnp.int32)}
  for tx in (
    optax_dls.static_loss_scale(optax.adamw(1e-2, weight_decay=0.5), 4.0),
    optax_dls.no_loss_scale(optax.adamw(1e-2, weight_decay=0.5)),
  ):
    state = tx.init(params)
    assert [a.shape for a in jax.tree.leaves(state.inner_state[0].mu)] == [(3,)]
    updates, _ = jax.jit(tx.update)(grads, state, params)
    assert updates["step"].dtype == jnp.int32 and int(updates["step"][0]) == 2  # untouched
    new, _ = jax.jit(functools.partial(apply_step, tx))(grads, state, params)
    assert int(new["step"][0]) == 7 and not np.array_equal(new["w"], params["w"])


def test_a_float0_gradient_of_an_integer_parameter_is_a_zero_update_optax_applies():
  params = {"w": jnp.ones(3), "step": jnp.array([5], jnp.int32)}
  tx = optax_dls.dynamic_loss_scale(optax.adamw(1e-2, weight_decay=0.5))
  state = tx.init(params)
  loss = lambda p: optax_dls.scale_loss(jnp.sum(p["w"] * p["step"]), state)
  grads = jax.grad(loss, allow_int=True)(params)
  assert grads["step"].dtype == jax.dtypes.float0
  updates, _ = jax.jit(tx.update)(grads, state, params)
  assert updates["step"].dtype == jnp.int32 and int(updates["step"][0]) == 0
  new = optax.apply_updates(params, updates)
  assert int(new["step"][0]) == 5 and not np.array_equal(new["w"], params["w"])


def test_integer_gradients_without_params_and_a_key_with_a_float0_gradient():
  params = {"w": jnp.ones(3), "i": jnp.arange(3, dtype=jnp.int32), "key": jax.random.key(0)}
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2))  # needs no params
  state = tx.init(params)
  loss = lambda p: optax_dls.scale_loss(jnp.sum(p["w"] * p["i"]), state)
  grads = jax.grad(loss, allow_int=True)(params)
  updates, _ = jax.jit(tx.update)(grads, state)  # no params: told by the gradients' dtype
  assert updates["i"] is None and updates["key"] is None and updates["w"].dtype == jnp.float32
  new, _ = jax.jit(functools.partial(apply_step, tx))(grads, state, params)
  np.testing.assert_array_equal(new["i"], params["i"])
  assert jax.random.key_data(new["key"]).tolist() == jax.random.key_data(params["key"]).tolist()
