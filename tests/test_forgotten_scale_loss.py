"""A forgotten ``scale_loss`` is said at trace time, once, where the step computes its
gradients and calls ``update`` in one traced function; nothing is said where the loss is
multiplied (by ``scale_loss``, by ``loss_scale``, by ``value_and_grad``), under
``no_loss_scale``, or where the gradients come into the traced function from elsewhere."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from _compat import apply_step

import optax_dls

PARAMS = {"w": jnp.ones(3), "n": jnp.arange(2, dtype=jnp.int32)}


def _records_parents():
  """Whether this JAX records the equation of each traced value (what the check reads)."""
  seen = []
  jax.make_jaxpr(lambda x: seen.append(getattr(x * 2, "parent", None)) or x)(1.0)
  return seen[0] is not None


pytestmark = pytest.mark.skipif(
  not _records_parents(), reason="this JAX records no parent equations: nothing is said"
)


def _loss(p, x):
  return jnp.sum((p["w"] * x) ** 2)


def _step(tx, how):
  def step(p, s, x):
    def lf(p):
      loss = _loss(p, x)
      if how == "scale_loss":
        return optax_dls.scale_loss(loss, s)
      if how == "loss_scale":
        return loss * optax_dls.find_state(s).loss_scale
      return loss  # forgotten

    g = jax.grad(lf, allow_int=True)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step)


@pytest.mark.parametrize("lowering", ["auto", "where", "cond"])
def test_a_forgotten_scale_loss_is_said_once_at_the_users_line(lowering):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), skip_lowering=lowering)
  state, step = tx.init(PARAMS), _step(tx, "forgotten")
  with pytest.warns(UserWarning, match=r"scale_loss\(loss, opt_state\)") as told:
    step(PARAMS, state, jnp.ones(3))
  assert [w.filename for w in told if "scale_loss" in str(w.message)] == [__file__]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(PARAMS, state, jnp.ones((3,)) * 2)  # cached: no trace, nothing said
    _step(tx, "forgotten")(PARAMS, state, jnp.ones(3))  # said once per tx


@pytest.mark.parametrize("how", ["scale_loss", "loss_scale"])
def test_a_multiplied_loss_says_nothing(how):
  tx = optax_dls.dynamic_loss_scale(optax.MultiSteps(optax.adam(0.1), 2))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _step(tx, how)(PARAMS, tx.init(PARAMS), jnp.ones(3))


def test_value_and_grad_no_loss_scale_and_given_gradients_say_nothing():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for tries in (0, 2):
      tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
      grad_fn = optax_dls.value_and_grad(lambda p, x: _loss(p, x), tx, max_tries=tries)

      def step(p, s, x, tx=tx, grad_fn=grad_fn):
        (_, g), s = grad_fn(s, p, x)
        return apply_step(tx, g, s, p)

      jax.jit(step)(PARAMS, tx.init(PARAMS), jnp.ones(3))
    plain = optax_dls.no_loss_scale(optax.sgd(0.1))
    _step(plain, "forgotten")(PARAMS, plain.init(PARAMS), jnp.ones(3))
    tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
    grads = {"w": jnp.ones(3), "n": None}  # computed elsewhere: nothing is known
    jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)


def test_through_a_flax_train_state_it_points_at_the_users_line():
  from flax.training import train_state

  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.ones(3)}
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

  @jax.jit
  def step(state, x):
    grads = jax.grad(lambda p: _loss(p, x))(state.params)  # forgotten
    return state.apply_gradients(grads=grads)

  with pytest.warns(UserWarning, match="optax_dls.flax.value_and_grad") as told:
    step(state, jnp.ones(3))
  assert [w.filename for w in told if "loss scale" in str(w.message)] == [__file__]


def test_a_plain_optax_state_handed_to_scale_loss_names_the_conversion():
  with pytest.raises(ValueError, match=r"into_loss_scaled\(old_state, tx.init\(params\)\)"):
    optax_dls.scale_loss(jnp.float32(1.0), optax.adam(0.1).init(PARAMS))


def test_a_tree_holding_the_state_handed_to_update_says_to_pass_the_state_itself():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  grads = {"w": jnp.ones(3), "n": None}
  with pytest.raises(TypeError, match="holding one: pass that state itself"):
    tx.update(grads, (tx.init(PARAMS),), PARAMS)
