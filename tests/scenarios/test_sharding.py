"""Loss scaling under jit with NamedSharding: data-parallel and FSDP-style, no axis_name; and the
record of the non-finite leaves, the same on every device, also under shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import pcast_varying
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

BAD_DEVICE = 6  # the one device whose shard gets the inf
NAN_DEVICE = 1  # the one device whose shard of another leaf gets a NaN


def _tx(lowering="auto", axis_name=None):
  return optax_dls.dynamic_loss_scale(
    optax.adam(1e-2),
    init_scale=2.0**10,
    growth_interval=2,
    skip_lowering=lowering,
    axis_name=axis_name,
  )


def _init(in_dim=16, out_dim=8):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (in_dim, out_dim)), "b": jax.random.normal(k2, (out_dim,))}


def _batch(step, n=32, in_dim=16, out_dim=8):
  k1, k2 = jax.random.split(jax.random.key(100 + step))
  return jax.random.normal(k1, (n, in_dim)), jax.random.normal(k2, (n, out_dim))


def _step(tx, params, state, x, y):
  def loss_fn(p):
    return optax_dls.scale_loss(jnp.mean((x @ p["w"] + p["b"][None] - y) ** 2), state)

  grads = jax.grad(loss_fn)(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def _put(tree, mesh, specs):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _state_specs(tx, state, param_specs):
  """Inner-state leaves shaped like the parameters take their spec; every other leaf is
  replicated."""
  return optax.tree_map_params(
    tx,
    lambda _, s: s,
    state,
    param_specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )


def _single_device_run(batches):
  tx, params = _tx(), _init()
  state = tx.init(params)
  step = jax.jit(lambda p, s, x, y: _step(tx, p, s, x, y))
  for x, y in batches:
    params, state = step(params, state, x, y)
  return params, state


def _assert_specs(tree, mesh, specs):
  for x, s in zip(
    jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P))
  ):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim), (x.sharding, s)


LAYOUTS = {
  # data-parallel: parameters replicated, batch split over all 8 devices.
  "data_parallel": ((8,), ("data",), {"w": P(), "b": P()}),
  # FSDP-style: parameters, gradients and optimizer state sharded too.
  "fsdp": ((4, 2), ("data", "model"), {"w": P("data", "model"), "b": P("model")}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_clean_steps_match_single_device_and_keep_shardings(layout, lowering):
  shape, names, pspecs = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
  tx = _tx(lowering=lowering)
  params = _put(_init(), mesh, pspecs)
  state = tx.init(params)
  sspecs = _state_specs(tx, state, pspecs)
  state = _put(state, mesh, sspecs)
  batches = [_batch(i) for i in range(3)]
  step = jax.jit(lambda p, s, x, y: _step(tx, p, s, x, y))
  for x, y in batches:
    x, y = _put((x, y), mesh, (P("data"), P("data")))
    params, state = step(params, state, x, y)

  ref_params, ref_state = _single_device_run(batches)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert (
    float(state.loss_scale) == float(ref_state.loss_scale) == 2.0**11
  )  # grew after 2 clean steps
  np.testing.assert_allclose(float(state.grad_norm), float(ref_state.grad_norm), rtol=1e-5)
  _assert_specs(params, mesh, pspecs)
  _assert_specs(state, mesh, sspecs)
  assert state.loss_scale.sharding.is_fully_replicated


@pytest.mark.parametrize(
  "layout,axis_type",
  [("data_parallel", AxisType.Explicit), ("fsdp", AxisType.Explicit), ("fsdp", AxisType.Auto)],
)
def test_inf_in_one_device_shard_skips_everywhere(layout, axis_type, lowering):
  shape, names, pspecs = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
  tx = _tx(lowering=lowering)
  params = _put(_init(), mesh, pspecs)
  state = _put(tx.init(params), mesh, _state_specs(tx, tx.init(params), pspecs))
  bad = mesh.devices.flat[BAD_DEVICE]

  # The gradient itself has inf in exactly one device's shard of "w" (sharded
  # under FSDP, replicated under data-parallel) and nowhere else.
  w_sharding = params["w"].sharding
  row, col = (sl.start or 0 for sl in w_sharding.devices_indices_map(params["w"].shape)[bad])
  w_grad = np.ones(params["w"].shape, np.float32)
  w_grad[row, col] = np.inf
  grads = {"w": jax.device_put(w_grad, w_sharding), "b": jnp.ones_like(params["b"])}
  if layout == "fsdp":
    owners = [
      s.device for s in grads["w"].addressable_shards if not np.isfinite(np.asarray(s.data)).all()
    ]
    assert owners == [bad]

  update = jax.jit(tx.update)
  updates, new_state = update(grads, state, params)
  new_params = optax.apply_updates(params, updates)

  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not bool(new_state.last_step_finite) and int(new_state.num_skipped) == 1
  assert new_state.loss_scale.sharding.is_fully_replicated
  scales = {float(s.data) for s in new_state.loss_scale.addressable_shards}
  assert scales == {2.0**9}
  for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_axis_name_under_plain_jit_is_a_clear_error(lowering):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), axis_name="data", skip_lowering=lowering)
  params = {"w": jnp.ones(3)}
  with pytest.raises(
    ValueError, match=r"axis_name='data': 'data' is not a mapped axis \(no axis is mapped here\)"
  ):
    jax.jit(tx.update).trace(params, tx.init(params), params)  # tracing only: nothing is compiled


# --- which leaves were not finite: the same record on every device ---------------------------

# Three leaves, each split over all 8 devices of the FSDP mesh (a 2 x 2 block per device).
NAMED_SPEC = P("data", "model")
NAMED_NAMES = ["dec/bias", "dec/kernel", "enc/kernel"]  # leaf order

# Steps in a row: a value placed in one device's block of a leaf (name: (device, value)),
# and the leaves every device must then name.
NAMED_STEPS = [
  ({"dec/kernel": (BAD_DEVICE, np.inf)}, {"dec/kernel": "inf"}),
  (
    {"dec/kernel": (BAD_DEVICE, -np.inf), "enc/kernel": (NAN_DEVICE, np.nan)},
    {"dec/kernel": "inf", "enc/kernel": "nan"},
  ),
  ({"enc/kernel": (NAN_DEVICE, np.nan)}, {"enc/kernel": "nan"}),
]


def _named_params():
  ones = lambda: np.ones((8, 4), np.float32)
  return {"dec": {"bias": ones(), "kernel": ones()}, "enc": {"kernel": ones()}}


def _named_grads(mesh, bad):
  """Gradients of ones where, for each ``name: (device, value)`` of ``bad``, the first entry
  of that device's block of leaf ``name`` is ``value``: no other device's block of it."""
  sharding = NamedSharding(mesh, NAMED_SPEC)
  grads = {}
  for name, g in zip(NAMED_NAMES, jax.tree.leaves(_named_params())):
    if name in bad:
      device, value = bad[name]
      idx = sharding.devices_indices_map(g.shape)[mesh.devices.flat[device]]
      g[tuple(sl.start or 0 for sl in idx)] = value
    grads[name] = jax.device_put(g, sharding)
  for name, (device, _) in bad.items():
    shards = grads[name].addressable_shards
    owners = [s.device for s in shards if not np.isfinite(np.asarray(s.data)).all()]
    assert owners == [mesh.devices.flat[device]], name
  return {
    "dec": {"bias": grads["dec/bias"], "kernel": grads["dec/kernel"]},
    "enc": {"kernel": grads["enc/kernel"]},
  }


def _each_device_names(state, rows):
  """The names each device's copy of the record (``[8, n + 2]``) decodes to."""
  return [
    optax_dls.nonfinite_leaves(state._replace(nonfinite=row), NAMED_NAMES)
    for row in np.asarray(rows)
  ]


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_every_device_names_the_leaf_of_one_device_s_shard(check_vma, lowering):
  shape, names, _ = LAYOUTS["fsdp"]
  mesh = jax.make_mesh(shape, names)
  tx = _tx(lowering=lowering, axis_name=names)
  pspecs = jax.tree.map(lambda _: NAMED_SPEC, _named_params())
  params = _put(_named_params(), mesh, pspecs)
  sspecs = _state_specs(tx, tx.init(params), pspecs)
  state = _put(tx.init(params), mesh, sspecs)

  def update(grads, state, params):
    _, state = tx.update(grads, state, params)
    mine = state.nonfinite[None]  # each device's own copy, one row per device
    return state, pcast_varying(mine, names) if check_vma else mine

  step = jax.jit(
    jax.shard_map(
      update,
      mesh=mesh,
      in_specs=(pspecs, sspecs, pspecs),
      out_specs=(sspecs, P(names)),
      check_vma=check_vma,
    )
  )
  for i, (bad, expected) in enumerate(NAMED_STEPS, start=1):
    state, rows = step(_named_grads(mesh, bad), state, params)
    assert rows.shape == (8, len(NAMED_NAMES) + 2)
    assert _each_device_names(state, rows) == [expected] * 8, i
    np.testing.assert_array_equal(np.asarray(rows)[:, -1], [i] * 8)
    assert optax_dls.nonfinite_leaves(state, params) == expected
    assert int(optax_dls.metrics(state)["nonfinite_step"]) == i


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_jit_every_device_names_the_leaf_of_one_device_s_shard(axis_type, lowering):
  shape, names, _ = LAYOUTS["fsdp"]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
  tx = _tx(lowering=lowering)
  pspecs = jax.tree.map(lambda _: NAMED_SPEC, _named_params())
  params = _put(_named_params(), mesh, pspecs)
  state = _put(tx.init(params), mesh, _state_specs(tx, tx.init(params), pspecs))
  update = jax.jit(tx.update)
  for i, (bad, expected) in enumerate(NAMED_STEPS, start=1):
    _, state = update(_named_grads(mesh, bad), state, params)
    record = state.nonfinite
    assert record.sharding.is_fully_replicated
    copies = [np.asarray(s.data) for s in record.addressable_shards]
    assert len(copies) == 8
    assert _each_device_names(state, copies) == [expected] * 8, i
    assert {int(c[-1]) for c in copies} == {i}
    assert optax_dls.nonfinite_leaves(state, params) == expected
