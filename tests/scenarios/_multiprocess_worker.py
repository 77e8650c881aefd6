"""One process of the 2-process test (test_multiprocess.py beside it); not a test itself.

Usage: python _multiprocess_worker.py PROCESS_ID PORT OUT_JSON
(the skip lowering from the environment variable OPTAX_DLS_TEST_LOWERING, default "auto")

Joins a 2-process CPU cluster on localhost (2 devices per process, gloo
collectives), then runs the same two steps under jit with NamedSharding (no
axis_name) and under shard_map (axis_name="data"): step 1 has an inf only in
a gradient shard held by process 1, step 2 is clean. Writes what this process
sees (every local device's loss scale and record of the non-finite leaves, the gathered
parameters) to OUT_JSON.
"""

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

PSPECS = {"w": P("data"), "b": P()}  # "w" sharded over all 4 devices, "b" replicated


def _tx(axis_name):
  return optax_dls.dynamic_loss_scale(
    optax.sgd(0.1),
    init_scale=2.0**10,
    axis_name=axis_name,
    skip_lowering=os.environ.get("OPTAX_DLS_TEST_LOWERING", "auto"),
  )


def _params():
  return {"w": np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3), "b": np.ones(3, np.float32)}


def _grads(scale, inf_row=None):
  w = np.cos(np.arange(24, dtype=np.float32)).reshape(8, 3) * scale
  if inf_row is not None:
    w[inf_row, 0] = np.inf
  return {"w": w, "b": np.full(3, 0.25 * scale, np.float32)}


def _global(tree, mesh, specs):
  """Global arrays; each process supplies only the blocks its own devices hold."""

  def one(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])

  return jax.tree.map(one, tree, specs)


def _local_records(state):
  """Each local device's copy of the record: its leaf names and its step."""
  rows = [np.asarray(s.data) for s in state.nonfinite.addressable_shards]
  return [
    {
      "leaves": optax_dls.nonfinite_leaves(state._replace(nonfinite=row), _params()),
      "step": int(row[-1]),
    }
    for row in rows
  ]


def _run(mesh, tx, step, state_specs, inf_row):
  """Step 0 with an inf in ``inf_row`` of "w", step 1 clean; what this process sees after each."""
  params = _global(_params(), mesh, PSPECS)
  state = jax.jit(
    tx.init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)
  )(params)
  out = {}
  for i, row in enumerate([inf_row, None]):
    scale = float(state.loss_scale.addressable_shards[0].data)
    params, state = step(params, state, _global(_grads(scale, row), mesh, PSPECS))
    out[f"step{i}"] = {
      "scales": [float(s.data) for s in state.loss_scale.addressable_shards],
      "finite": [int(s.data) == 0 for s in state.consecutive_skips.addressable_shards],
      "nonfinite": _local_records(state),
      "nonfinite_leaves": optax_dls.nonfinite_leaves(state, params),
      "nonfinite_step": int(optax_dls.metrics(state)["nonfinite_step"]),
      "params": {
        k: multihost_utils.process_allgather(v, tiled=True).tolist() for k, v in params.items()
      },
    }
  return out


def _train_step(tx):
  def f(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return f


def _jit_run(mesh, state_specs, inf_row):
  """jit with NamedSharding: no axis_name, the all-finite reduction is global."""
  tx = _tx(None)
  return _run(mesh, tx, jax.jit(_train_step(tx)), state_specs, inf_row)


def _shard_map_run(mesh, state_specs, inf_row):
  """shard_map over "data", with axis_name="data"."""
  tx = _tx("data")
  step = jax.jit(
    jax.shard_map(
      _train_step(tx),
      mesh=mesh,
      in_specs=(PSPECS, state_specs, PSPECS),
      out_specs=(PSPECS, state_specs),
    )
  )
  return _run(mesh, tx, step, state_specs, inf_row)


def _reference(inf_row):
  """The same two steps on one local device, no sharding."""
  tx = _tx(None)
  params = jax.tree.map(jnp.asarray, _params())
  state = tx.init(params)
  for row in [inf_row, None]:
    grads = jax.tree.map(jnp.asarray, _grads(float(state.loss_scale), row))
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
  return {k: np.asarray(v).tolist() for k, v in params.items()}


def main():
  process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=60,
  )
  assert jax.process_count() == 2 and jax.local_device_count() == 2, jax.devices()
  mesh = jax.make_mesh((4,), ("data",))
  w_map = NamedSharding(mesh, PSPECS["w"]).devices_indices_map((8, 3))
  rows = {d.process_index: w_map[d][0].start for d in mesh.devices.flat}
  inf_row = rows[1]  # first row held by a device of process 1

  tx = _tx(None)
  state_specs = optax.tree_map_params(
    tx,
    lambda _, s: s,
    tx.init(_params()),
    PSPECS,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )
  result = {
    "process_index": jax.process_index(),
    "inf_row": inf_row,
    "jit": _jit_run(mesh, state_specs, inf_row),
    "shard_map": _shard_map_run(mesh, state_specs, inf_row),
    "reference": _reference(inf_row),
  }
  with open(out_path, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
