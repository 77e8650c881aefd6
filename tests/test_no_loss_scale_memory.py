"""``no_loss_scale`` costs what the bare optimizer costs, in memory too: a donated step
compiled with XLA's defaults aliases every donated buffer to an output, needs the bare
optimizer's scratch memory give or take a few scalars, and has no more copies than it.

The step takes the parameters and the optimizer state (both donated), the gradients (not
donated: a buffer of theirs cannot take the unscaled gradients) and a batch: ``tx.update``
and ``optax.apply_updates``, and ``apply_step``, on the gradients handed in, against the
bare optimizer's ``tx.update`` and ``optax.apply_updates``; ``optax_dls.value_and_grad`` of
the loss then ``apply_step``, against ``jax.grad`` and the bare optimizer. On one device,
and on 8 with the kernel sharded (FSDP) and ``in_shardings`` / ``out_shardings`` (Auto and
Explicit axes). (Through ``value_and_grad`` the old scale is not read, for the step to be
bit for bit the plain one: its 4 bytes are the one donated buffer not reused.)"""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from _compat import apply_step, jit_xla_defaults
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

IN, OUT, BATCH = 256, 64, 32
# The scratch memory no_loss_scale may need beyond the bare optimizer's: its state's scalar
# fields, aligned; far below one device's share of the kernel (8 KiB on 8 devices).
SCALARS = 256

INNERS = {
  "adam": lambda: optax.adam(1e-3),
  "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-3, weight_decay=0.1), every_k_schedule=2),
}
PLACES = {"one_device": None, "mesh_auto": AxisType.Auto, "mesh_explicit": AxisType.Explicit}


def _loss(params, x):
  return jnp.mean(jnp.square(x @ params["w"] + params["b"][None, :]))


def _step(tx, path):
  def step(params, opt_state, grads, x):
    if path == "value_and_grad":
      (_, grads), opt_state = optax_dls.value_and_grad(_loss, tx)(opt_state, params, x)
    elif path == "grad":
      grads = jax.grad(_loss)(params, x)
    if path in ("apply_step", "value_and_grad"):
      return apply_step(tx, grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def _spec(x):
  return P("data", None) if x.shape == (IN, OUT) else P()  # the kernel split, the rest replicated


def _program(tx, path, axis_type):
  """``(memory_analysis, optimized HLO, bytes donated per device)`` of the donated step."""
  params = {"w": jnp.full((IN, OUT), 0.01), "b": jnp.zeros(OUT)}
  grads = jax.tree.map(jnp.ones_like, params)
  x = jnp.ones((BATCH, IN))
  if axis_type is None:
    args = (params, tx.init(params), grads, x)
    compiled = jit_xla_defaults(_step(tx, path), donate_argnums=(0, 1)).lower(*args).compile()
  else:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
      shardings = lambda tree: jax.tree.map(lambda a: NamedSharding(mesh, _spec(a)), tree)
      params = jax.device_put(params, shardings(params))
      grads = jax.device_put(grads, shardings(grads))
      state_shardings = shardings(jax.eval_shape(tx.init, params))
      state = jax.jit(tx.init, out_shardings=state_shardings)(params)
      x = jax.device_put(x, NamedSharding(mesh, P("data")))
      args = (params, state, grads, x)
      step = jit_xla_defaults(
        _step(tx, path),
        in_shardings=(shardings(params), state_shardings, shardings(grads), x.sharding),
        out_shardings=(shardings(params), state_shardings),
        donate_argnums=(0, 1),
      )
      compiled = step.lower(*args).compile()
  donated = sum(
    math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(args[:2])
  )
  return compiled.memory_analysis(), compiled.as_text(), donated


def _copies(hlo):
  return hlo.count(" copy(")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what XLA's CPU backend compiles")
@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_no_loss_scale_reuses_every_donated_buffer_and_needs_the_bare_optimizers_memory(
  inner, place
):
  bare = {path: _program(INNERS[inner](), path, PLACES[place]) for path in ("update", "grad")}
  for path, like in (("update", "update"), ("apply_step", "update"), ("value_and_grad", "grad")):
    base, base_hlo, base_donated = bare[like]
    assert base.alias_size_in_bytes == base_donated  # what is measured: every buffer reused
    tx = optax_dls.no_loss_scale(INNERS[inner]())
    got, hlo, donated = _program(tx, path, PLACES[place])
    # No buffer of the gradients' (or the parameters') size beyond the bare optimizer's:
    # the unscaling fuses into the optimizer's read of the gradients.
    assert abs(got.temp_size_in_bytes - base.temp_size_in_bytes) <= SCALARS, (
      path,
      got.temp_size_in_bytes,
      base.temp_size_in_bytes,
    )
    if path == "value_and_grad":
      # value_and_grad hands update the constant scale 1 (the loss is not multiplied), so
      # that the step is bit for bit the plain one: the old scale is not read, and JAX
      # leaves its donated float32 () out of the program. Every other buffer is reused.
      assert got.alias_size_in_bytes == donated - 4, (got.alias_size_in_bytes, donated)
      continue
    # Every donated buffer (the parameters, the inner state and each scalar of the
    # loss-scale state) is an output's: none is left out of the program unread, none
    # holds an output of the wrong field.
    assert got.alias_size_in_bytes == donated, (path, got.alias_size_in_bytes, donated)
    # No copy the bare optimizer has not: no field of the new state is a constant, which
    # XLA would copy into the field's donated buffer.
    if jax.__version_info__ >= (0, 10):
      assert _copies(hlo) <= _copies(base_hlo), (path, _copies(hlo), _copies(base_hlo))
