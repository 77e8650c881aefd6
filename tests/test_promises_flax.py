"""The promises of the ``optax_dls.flax`` docstrings not held elsewhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import optax_dls
import optax_dls.flax as dls_flax


def _state(init_scale=4.0, **kwargs):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=init_scale, **kwargs)
  return TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)


def _sum(p):
  return jnp.sum(p["w"])


def test_grad_fn_built_once_reads_the_scale_when_called():
  grad_fn = dls_flax.value_and_grad(_sum)
  state = _state()
  (_, grads), _ = grad_fn(state, state.params)
  assert grads["w"].tolist() == [4.0, 4.0]
  state = state.replace(opt_state=optax_dls.reset_scale(state.opt_state, 64.0))
  (_, grads), _ = grad_fn(state, state.params)
  assert grads["w"].tolist() == [64.0, 64.0]


def test_a_float16_loss_comes_back_as_fun_returned_it():
  state = _state(init_scale=2.0**15)
  grad_fn = dls_flax.value_and_grad(lambda p: (jnp.sum(p["w"]) * 30000).astype(jnp.float16))
  (loss, grads), _ = grad_fn(state, state.params)
  assert loss.dtype == jnp.float16 and float(loss) == 60000.0
  assert grads["w"].tolist() == [2.0**15 * 30000] * 2  # S * loss would be inf in float16


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(max_tries=65), ValueError, "max_tries"),
    (dict(max_tries=-1), ValueError, "max_tries"),
    (dict(max_tries=2.0), TypeError, "max_tries"),
    (dict(fp32_fun=_sum), ValueError, "pass max_tries"),
    (dict(fp32_fun=3, max_tries=1), TypeError, "fp32_fun must be callable"),
    (dict(argnums=(0, 0)), ValueError, "argnums must not repeat"),
    (dict(argnums=-1), ValueError, "argnums must be >= 0"),
  ],
)
def test_value_and_grad_refuses_what_its_docstring_refuses(kwargs, error, match):
  with pytest.raises(error, match=match):
    dls_flax.value_and_grad(_sum, **kwargs)


def test_when_called_a_non_floating_loss_or_missing_arguments_raise_type_error():
  state = _state()
  integer = dls_flax.value_and_grad(lambda p: jnp.sum(p["w"]).astype(jnp.int32))
  with pytest.raises(TypeError, match="loss must be a floating-point array"):
    integer(state, state.params)
  second = dls_flax.value_and_grad(lambda p, q: jnp.sum(q["w"]), argnums=1)
  with pytest.raises(TypeError, match="argnums=1 asks for positional argument 1"):
    second(state, state.params)
  several = state.replace(opt_state=(state.opt_state, state.opt_state))
  with pytest.raises(ValueError, match="2 LossScaleStates"):
    dls_flax.value_and_grad(_sum)(several, state.params)


def test_the_checkpoint_port_names_a_wrong_argument():
  for raw in ({"params": 1}, [1]):
    with pytest.raises(
      TypeError, match="source must be a flax DynamicScale.* 'dynamic_scale' entry"
    ):
      dls_flax.from_dynamic_scale(raw, _state())


def test_from_dynamic_scale_checks_the_scale_against_the_range_it_documents():
  state = _state(max_scale=2.0**24)
  big = {"scale": 2.0**120, "fin_steps": 0}
  ported = dls_flax.from_dynamic_scale(big, state)  # a TrainState: the next update settles it
  assert float(optax_dls.find_state(ported).loss_scale) == 2.0**120
  ported = ported.apply_gradients(grads=jax.tree.map(jnp.zeros_like, ported.params))
  assert float(optax_dls.find_state(ported).loss_scale) == 2.0**24
  assert float(dls_flax.from_dynamic_scale(big, state.opt_state).loss_scale) == 2.0**120
  for scale in (2.0**127, float("nan"), float("inf"), 0.0):
    with pytest.raises(ValueError, match="dynamic_scale.scale"):
      dls_flax.from_dynamic_scale({"scale": scale, "fin_steps": 0}, state.opt_state)
  with pytest.raises(TypeError, match="dynamic_scale.fin_steps must be an integer"):
    dls_flax.from_dynamic_scale({"scale": 2.0, "fin_steps": 1.5}, state.opt_state)
  with pytest.raises(TypeError, match="static Python number"):
    jax.jit(lambda s: dls_flax.from_dynamic_scale({"scale": s, "fin_steps": 1}, state.opt_state))(
      2.0
    )
  with pytest.raises(ValueError, match="no LossScaleState"):
    dls_flax.from_dynamic_scale({"scale": 2.0, "fin_steps": 1}, {"w": jnp.ones(2)})


def test_from_dynamic_scale_sets_every_growth_tracker_and_keeps_the_other_fields():
  policy = optax_dls.fp32_fallback(optax_dls.config.preset("flax", growth_interval=10), after=3)
  state = optax_dls.loss_scaled(optax.sgd(0.1), policy).init({"w": jnp.ones(2)})
  new = dls_flax.from_dynamic_scale({"scale": 64.0, "fin_steps": 5}, state)
  assert float(new.loss_scale) == 64.0
  # inside the fallback's state, inside its count of skips at the minimum scale
  assert int(new.policy_state.policy_state.policy_state.growth_tracker) == 5
  kept = new._replace(
    loss_scale=state.loss_scale,
    policy_state=new.policy_state._replace(policy_state=state.policy_state.policy_state),
  )
  assert jax.tree.all(
    jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b, equal_nan=True)), kept, state)
  )


def test_an_nnx_module_is_differentiated_with_respect_to_the_optimizer_s_wrt():
  from flax import nnx

  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  wrt = nnx.All(nnx.Param, nnx.PathContains("bias"))
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
  optimizer = nnx.Optimizer(model, tx, wrt=wrt)
  grad_fn = dls_flax.value_and_grad(lambda m, x: jnp.sum(m(x)))
  (_, grads), optimizer = grad_fn(optimizer, model, jnp.ones((3, 2)))
  pure = nnx.to_pure_dict(grads)
  assert list(pure) == ["bias"] and pure["bias"].tolist() == [12.0]  # S = 4 times 3 rows
  kernel = jnp.copy(model.kernel[...])
  optimizer.update(model, grads)
  np.testing.assert_allclose(model.bias[...], [-0.3], rtol=1e-6)
  assert bool(jnp.all(model.kernel[...] == kernel))


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")  # flax 0.12 deprecates it
@pytest.mark.parametrize("max_tries", [None, 2])
def test_a_fun_that_sows_into_its_module_is_told_so(max_tries):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(2, 1, rngs=rngs)

    def __call__(self, x):
      y = self.lin(x)
      self.sow(nnx.Intermediate, "y", y)
      return y

  model = Net(nnx.Rngs(0))
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grad_fn = dls_flax.value_and_grad(lambda m, x: jnp.sum(m(x)), max_tries=max_tries)
  with pytest.raises(ValueError, match=r"fun added variables .*\['y/0'\].*has_aux=True"):
    grad_fn(optimizer, model, jnp.ones((3, 2)))


class _Changes(nnx.Module):
  def __init__(self, mode):
    self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.mode = mode

  def __call__(self, x):
    y = self.lin(x)
    if self.mode == "param":
      self.extra = nnx.Param(jnp.ones(2))
    elif self.mode == "delete":
      del self.lin.bias
    elif self.mode == "attribute":
      self.cache = jnp.ones(2)
    return y


@pytest.mark.parametrize(
  ("mode", "named"), [("param", "extra"), ("delete", "lin/bias"), ("attribute", "cache|structure")]
)
@pytest.mark.parametrize("max_tries", [None, 2])
def test_a_fun_that_adds_or_removes_any_variable_is_told_so(mode, named, max_tries):
  """A Param added, a variable deleted or a new attribute: each changes the module's
  structure, which value_and_grad cannot merge back; never silently dropped."""
  model = _Changes(mode)
  optimizer = nnx.Optimizer(model, optax_dls.dynamic_loss_scale(optax.sgd(0.1)), wrt=nnx.Param)
  grad_fn = dls_flax.value_and_grad(lambda m, x: jnp.mean(m(x)), max_tries=max_tries)
  with pytest.raises(ValueError, match=rf"(?s)fun added variables.*({named}).*has_aux=True"):
    grad_fn(optimizer, model, jnp.ones((3, 2)))
