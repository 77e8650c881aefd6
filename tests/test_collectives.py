"""The skip adds only small collectives: no parameter-sized gather on a mesh.

The update and ``apply_step`` of ``dynamic_loss_scale`` are compiled beside those of
``no_loss_scale`` on sharded parameters, and the collectives of the compiled programs
compared.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

MOVES = ("all-gather", "all-to-all", "collective-permute")
# Each added all-reduce carries at most this many elements per leaf (flags, sums, codes).
PER_LEAF = 4
SPECS = {
  "data": {"w": P(), "b": P(), "v": P()},
  "fsdp": {"w": P("data", None), "b": P("data"), "v": P(("data", "model"))},
  "tensor": {"w": P(None, "model"), "b": P("model"), "v": P("model")},
}
SHAPES = {"w": (64, 32), "b": (32,), "v": (256,)}


def _collectives(text):
  """``{kind: [element counts]}`` of the collectives in compiled HLO text."""
  out = {}
  for line in text.splitlines():
    m = re.search(
      r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|all-to-all|collective-permute)"
      r"(?:-start)?\(",
      line,
    )
    if not m:
      continue
    sizes = [
      int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      for dims in re.findall(r"\[([\d,]*)\]", m.group(1))
    ]
    out.setdefault(m.group(2), []).append(sum(sizes))
  return out


def _programs(tx, params, grads):
  state = tx.init(params)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  step = jax.jit(lambda g, s, p: apply_step(tx, g, s, p))
  return [f.lower(grads, state, params).compile().as_text() for f in (update, step)]


def _compare(base_texts, dls_texts, n_leaves):
  for base_text, text in zip(base_texts, dls_texts, strict=True):
    base, dls = _collectives(base_text), _collectives(text)
    for kind in MOVES:
      assert sorted(dls.get(kind, [])) == sorted(base.get(kind, [])), (kind, base, dls)
    added = list(dls.get("all-reduce", []))
    for n in base.get("all-reduce", []):
      added.remove(n)
    assert all(n <= PER_LEAF * n_leaves for n in added), (base, dls)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("layout", sorted(SPECS))
def test_jit_on_a_mesh_adds_no_parameter_sized_collective(layout, axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  shard = {k: NamedSharding(mesh, s) for k, s in SPECS[layout].items()}
  params = {k: jax.device_put(jnp.ones(SHAPES[k], jnp.float32), shard[k]) for k in SHAPES}
  grads = {k: jax.device_put(jnp.ones(SHAPES[k], jnp.float16), shard[k]) for k in SHAPES}
  with jax.set_mesh(mesh):
    base = _programs(optax_dls.no_loss_scale(optax.adam(1e-3)), params, grads)
    dls = _programs(optax_dls.dynamic_loss_scale(optax.adam(1e-3)), params, grads)
  _compare(base, dls, len(SHAPES))


def test_shard_map_adds_no_parameter_sized_collective():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  spec = SPECS["fsdp"]
  params = {k: jnp.ones(SHAPES[k], jnp.float32) for k in SHAPES}
  grads = {k: jnp.ones(SHAPES[k], jnp.float16) for k in SHAPES}

  def texts(tx):
    state = tx.init(params)
    sspec = optax.tree_map_params(
      tx,
      lambda _, s: s,
      state,
      spec,
      transform_non_params=lambda _: P(),
      is_leaf=lambda x: isinstance(x, P),
    )
    out = []
    for fn in (
      lambda g, s, p: tx.update(g, s, p),
      lambda g, s, p: apply_step(tx, g, s, p),
    ):
      mapped = jax.shard_map(fn, mesh=mesh, in_specs=(spec, sspec, spec), out_specs=(spec, sspec))
      out.append(jax.jit(mapped).lower(grads, state, params).compile().as_text())
    return out

  axes = ("data", "model")
  base = texts(optax_dls.no_loss_scale(optax.adam(1e-3), axis_name=axes))
  dls = texts(optax_dls.dynamic_loss_scale(optax.adam(1e-3), axis_name=axes))
  _compare(base, dls, len(SHAPES))


def test_pmap_adds_no_parameter_sized_collective():
  n = 8
  params = {k: jnp.ones((n, *SHAPES[k]), jnp.float32) for k in SHAPES}
  grads = {k: jnp.ones((n, *SHAPES[k]), jnp.float16) for k in SHAPES}

  def texts(tx):
    state = jax.pmap(tx.init)(params)
    out = []
    for fn in (
      lambda g, s, p: tx.update(g, s, p),
      lambda g, s, p: apply_step(tx, g, s, p),
    ):
      out.append(jax.pmap(fn, axis_name="i").lower(grads, state, params).compile().as_text())
    return out

  base = texts(optax_dls.no_loss_scale(optax.adam(1e-3), axis_name="i"))
  dls = texts(optax_dls.dynamic_loss_scale(optax.adam(1e-3), axis_name="i"))
  _compare(base, dls, len(SHAPES))
