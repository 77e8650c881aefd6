"""A trainer that builds its optimizer inside its jitted init, as nanodo does (flax's
``TrainState.create`` under ``jax.jit``, the state's shardings from ``jax.eval_shape`` of
that init): FSDP-sharded parameters on 8 devices, ``dynamic_loss_scale(optax.MultiSteps(
optax.adamw(...), 2))``, a step jitted with ``in_shardings``, ``out_shardings`` and the
state donated, under ``jax_numpy_rank_promotion="raise"``.

The transformation is then built in a trace, and must keep nothing of that trace: a tracer
kept by it was closed over by every update, and JAX's dispatch fast path left the argument it
became out of the second call ("Execution supplied N arguments but compiled program
expected N+k", a misplaced sharding, or a crash)."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls
from optax_dls import group_scale

IN, OUT, BATCH = 16, 8, 32
PARAM_SPECS = {"w": P("data", None), "b": P()}  # FSDP: the kernel split over the devices
POISONED = 2  # the step whose loss is inf


@dataclasses.dataclass
class TrainState:
  """As flax's ``TrainState``: the optimizer rides in the tree structure, not as a leaf."""

  step: jax.Array
  params: Any
  opt_state: Any
  tx: Any


jax.tree_util.register_dataclass(
  TrainState, data_fields=["step", "params", "opt_state"], meta_fields=["tx"]
)


def _tx():
  inner = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=2)
  return optax_dls.dynamic_loss_scale(inner, init_scale=2.0**10, growth_interval=1000)


def _init(key):
  k1, k2 = jax.random.split(key)
  params = {"w": jax.random.normal(k1, (IN, OUT)), "b": jax.random.normal(k2, (OUT,))}
  tx = _tx()  # built here, inside the trace of the jitted init
  return TrainState(jnp.zeros([], jnp.int32), params, tx.init(params), tx)


def _train_step(state, batch):
  x, y, poison = batch

  def loss_fn(params):
    w, b = params["w"].astype(jnp.float16), params["b"].astype(jnp.float16)
    pred = (x.astype(jnp.float16) @ w + b[None, :]).astype(jnp.float32)
    loss = jnp.mean(jnp.square(pred - y)) * poison
    return optax_dls.scale_loss(loss, state.opt_state), loss

  grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state), loss


def _state_shardings(abstract, mesh):
  """Leaves shaped like the kernel split as the kernel, every other leaf replicated."""
  kernel = abstract.params["w"].shape
  spec = lambda x: PARAM_SPECS["w"] if x.shape == kernel else P()
  return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), abstract)


def _copy(tree):
  return [np.array(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_jitted_init_and_sharded_donated_steps_with_multisteps(axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  replicated = NamedSharding(mesh, P())
  key = jax.random.key(0)
  with jax.numpy_rank_promotion("raise"):
    abstract = jax.eval_shape(_init, key)
    shardings = _state_shardings(abstract, mesh)
    state = jax.jit(_init, out_shardings=shardings)(key)
    batch_shardings = (NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data")), replicated)
    step = jax.jit(
      _train_step,
      in_shardings=(shardings, batch_shardings),
      out_shardings=(shardings, replicated),
      donate_argnums=0,
    )
    rng = np.random.default_rng(0)
    for i in range(5):
      x = rng.standard_normal((BATCH, IN), np.float32)
      y = rng.standard_normal((BATCH, OUT), np.float32)
      poison = np.float32(np.inf if i == POISONED else 1.0)
      if i == POISONED:
        kept = _copy((state.params, state.opt_state.inner_state))
      state, loss = step(state, (x, y, poison))
      assert np.isfinite(float(loss)) == (i != POISONED)
      if i == POISONED:
        assert not bool(state.opt_state.last_step_finite)
        got = _copy((state.params, state.opt_state.inner_state))
        for a, b in zip(got, kept, strict=True):
          np.testing.assert_array_equal(a, b)  # bit for bit: the step was skipped

  assert step._cache_size() == 1  # one trace, one program for every step
  assert int(state.step) == 5 and int(state.opt_state.num_steps) == 5
  assert int(state.opt_state.num_skipped) == 1
  assert float(optax_dls.find_state(state.opt_state).loss_scale) == 2.0**9
  assert int(state.opt_state.inner_state.gradient_step) == 2  # 4 applied micro-batches, k=2
  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
  assert all(np.isfinite(a).all() for a in _copy(state))


BUILT_IN_A_TRACE = {
  "dynamic_multisteps": _tx,
  "static": lambda: optax_dls.static_loss_scale(optax.sgd(0.1), 8.0),
  "no_loss_scale": lambda: optax_dls.no_loss_scale(optax.sgd(0.1)),
  "amax": lambda: optax_dls.loss_scaled(optax.sgd(0.1), optax_dls.amax_policy()),
  "fp32_fallback": lambda: optax_dls.loss_scaled(
    optax.sgd(0.1), optax_dls.fp32_fallback(optax_dls.dynamic_policy())
  ),
  "group_unscale": lambda: optax_dls.dynamic_loss_scale(
    optax.chain(group_scale.group_unscale(4.0, {"w": True, "b": False}), optax.sgd(0.1))
  ),
}


@pytest.mark.parametrize("name", sorted(BUILT_IN_A_TRACE))
def test_a_transformation_built_in_a_trace_keeps_no_tracer(name):
  """Built inside a jitted init and kept (as a ``TrainState`` keeps it), the transformation
  holds no tracer of that trace, and its update runs twice through one program."""
  params = {"w": jnp.ones((4, 2)), "b": jnp.ones(2)}
  built = []

  def init(p):
    built.append(BUILT_IN_A_TRACE[name]())
    return built[-1].init(p)

  with jax.checking_leaks():
    state = jax.jit(init)(params)
  tx = built[-1]
  update = jax.jit(lambda g, s: tx.update(g, s, params)[1])
  grads = {"w": jnp.ones((4, 2)), "b": jnp.ones(2)}
  state = update(grads, update(grads, state))
  assert int(state.num_steps) == 2 and update._cache_size() == 1
