"""Loss scaling under shard_map and pmap: axis_name reduces the skip decision and the statistics."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import pcast_varying
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

BAD = (3, 1)  # mesh coordinates (data, model) of the one device whose shard gets the inf
AXES = ("data", "model")
PSPECS = {"w": P("data", "model"), "b": P()}  # "w" sharded over both axes, "b" replicated


def _tx(axis_name, lowering="auto"):
  return optax_dls.dynamic_loss_scale(
    optax.adam(1e-2),
    init_scale=2.0**10,
    growth_interval=2,
    axis_name=axis_name,
    skip_lowering=lowering,
  )


def _params():
  return {"w": jnp.arange(32.0).reshape(8, 4) / 32, "b": jnp.ones((4,))}


def _grads(scale, bad=None):
  """Scaled gradients; with ``bad``, an inf in the "w" block of that mesh device only."""
  w = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4) * scale
  if bad is not None:
    w[2 * bad[0], 2 * bad[1]] = np.inf  # rows 2i:2i+2, cols 2j:2j+2 live on device (i, j)
  return {"w": jnp.asarray(w), "b": jnp.full((4,), 0.5 * scale)}


def _state_specs(tx, state, specs=PSPECS):
  return optax.tree_map_params(
    tx,
    lambda _, s: s,
    state,
    specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )


def _put(mesh, tree, specs):
  return jax.tree.map(lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), tree, specs)


def _sharded_update(tx, mesh, check_vma=True):
  """jit(shard_map(tx.update)), also returning each device's (scale, finite, skipped, norm)."""
  state_specs = _state_specs(tx, tx.init(_params()))

  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    fields = (state.loss_scale, state.last_step_finite, state.num_skipped, state.grad_norm)
    per_device = jnp.stack([jnp.asarray(f, jnp.float32) for f in fields])[None]
    if check_vma:
      per_device = pcast_varying(per_device, AXES)
    return updates, state, per_device

  fn = jax.shard_map(
    update,
    mesh=mesh,
    in_specs=(PSPECS, state_specs, PSPECS),
    out_specs=(PSPECS, state_specs, P(AXES)),
    check_vma=check_vma,
  )

  def run(grads, state, params):
    put = functools.partial(_put, mesh)
    return jax.jit(fn)(put(grads, PSPECS), put(state, state_specs), put(params, PSPECS))

  return run


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((4, 2), AXES)


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_inf_in_one_shard_every_device_skips(mesh, check_vma, lowering):
  tx = _tx(AXES, lowering=lowering)
  params = _params()
  state = tx.init(params)
  run = _sharded_update(tx, mesh, check_vma)
  updates, new_state, per_device = run(_grads(2.0**10, bad=BAD), state, params)
  per_device = np.asarray(per_device)  # one row per device: scale, finite, skipped, norm
  assert per_device.shape == (8, 4)
  np.testing.assert_array_equal(per_device[:, :3], np.tile([2.0**9, 0.0, 1.0], (8, 1)))
  assert not np.isfinite(per_device[:, 3]).any()
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(u), 0.0)
  for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shard_map_clean_steps_match_single_device_and_norm_is_global(mesh, lowering):
  tx = _tx(AXES, lowering=lowering)
  params = _params()
  state = ref_state = tx.init(params)
  ref_params = params
  run = _sharded_update(tx, mesh)
  ref_update = jax.jit(_tx(None, lowering=lowering).update)
  for step in range(3):
    grads = _grads(float(state.loss_scale) * (step + 1))
    updates, state, per_device = run(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = ref_update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
    norms = np.asarray(per_device)[:, 3]
    # The stored norm is the norm of the whole gradient: "w"'s shards summed
    # over both axes, replicated "b" counted once; the same on every device.
    np.testing.assert_allclose(norms, float(ref_state.grad_norm), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert float(state.loss_scale) == float(ref_state.loss_scale) == 2.0**11


def test_shard_map_norm_of_huge_finite_gradients_is_global_without_overflow(mesh, lowering):
  # Scaled gradients near 1e20: their squares overflow float32, their norm does not.
  tx = _tx(AXES, lowering=lowering)
  params = _params()
  grads = _grads(1e20)
  _, _state, per_device = _sharded_update(tx, mesh)(grads, tx.init(params), params)
  per_device = np.asarray(per_device)
  assert per_device[:, 1].all() and not per_device[:, 2].any()  # every device applies the step
  expected = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads.values())) / 2.0**10
  np.testing.assert_allclose(per_device[:, 3], expected, rtol=1e-5)
  single = jax.jit(_tx(None, lowering=lowering).update)(
    grads, _tx(None, lowering=lowering).init(params), params
  )[1]
  np.testing.assert_allclose(float(single.grad_norm), expected, rtol=1e-5)


@pytest.mark.parametrize("axis_name", [None, "data", ("model",)])
def test_shard_map_missing_axis_name_raises_at_trace_time(mesh, axis_name, lowering):
  tx = _tx(axis_name, lowering=lowering)
  params = _params()
  state_specs = _state_specs(tx, tx.init(params))
  fn = jax.shard_map(
    tx.update, mesh=mesh, in_specs=(PSPECS, state_specs, PSPECS), out_specs=(PSPECS, state_specs)
  )
  put = lambda t, s: jax.tree.map(lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), t, s)
  args = put(_grads(1.0), PSPECS), put(tx.init(params), state_specs), put(params, PSPECS)
  with pytest.raises(ValueError, match=r"axis_name=.*'model'") as err:
    jax.jit(fn).trace(*args)  # tracing only: nothing is compiled
  assert "axis_name" in str(err.value)


def test_shard_map_data_parallel_without_axis_name(mesh, lowering):
  """Replicated parameters: shard_map's autodiff all-reduces the gradients, so they
  are invariant, no axis_name is needed, and an inf in one device's batch skips all."""
  mesh = jax.make_mesh((8,), ("data",))
  tx = _tx(None, lowering=lowering)
  params = {"w": jnp.ones((4, 2))}
  x = np.ones((16, 4), np.float32)
  x[2 * 6, 0] = np.inf  # batch rows 12:14 live on device 6

  def step(params, state, x):
    grads = jax.grad(lambda p: optax_dls.scale_loss(jnp.sum(x @ p["w"]), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())))
  put = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))
  new_params, state = fn(put(params, P()), put(tx.init(params), P()), put(x, P("data")))
  np.testing.assert_array_equal(np.asarray(new_params["w"]), 1.0)
  assert int(state.num_skipped) == 1 and float(state.loss_scale) == 2.0**9


def _pmap(fn, **kw):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return jax.pmap(fn, **kw)


def test_pmap_inf_on_one_device_every_device_skips(lowering):
  n = jax.device_count()
  tx = _tx("batch", lowering=lowering)
  params = {"w": jnp.ones((3,))}
  grads = {"w": jnp.full((n, 3), 2.0**10).at[6, 1].set(jnp.inf)}  # device 6 only
  update = _pmap(tx.update, axis_name="batch", in_axes=(0, None, None))
  updates, state = update(grads, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(state.loss_scale), np.full(n, 2.0**9))
  np.testing.assert_array_equal(np.asarray(state.last_step_finite), np.zeros(n, bool))
  np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)


def test_pmap_clean_steps_match_single_device(lowering):
  n = jax.device_count()
  tx = _tx("batch", lowering=lowering)
  params = ref_params = {"w": jnp.linspace(-1.0, 1.0, 5)}
  state = ref_state = tx.init(params)
  xs = jnp.arange(n * 5.0).reshape(n, 5) / 40

  def step(params, state, x):
    grads = jax.grad(lambda p: optax_dls.scale_loss(jnp.sum(jnp.sin(p["w"] * x)), state))(params)
    updates, state = tx.update(lax.pmean(grads, "batch"), state, params)
    return optax.apply_updates(params, updates), state

  def ref_step(params, state):
    grads = jax.grad(
      lambda p: optax_dls.scale_loss(jnp.mean(jnp.sin(p["w"][None] * xs).sum(1)), state)
    )(params)
    updates, state = _tx(None, lowering=lowering).update(grads, state, params)
    return optax.apply_updates(params, updates), state

  pstep = _pmap(step, axis_name="batch", in_axes=(None, None, 0), out_axes=None)
  for _ in range(3):
    params, state = pstep(params, state, xs)
    ref_params, ref_state = jax.jit(ref_step)(ref_params, ref_state)
  np.testing.assert_allclose(
    np.asarray(params["w"]), np.asarray(ref_params["w"]), rtol=1e-5, atol=1e-6
  )
  assert float(state.loss_scale) == float(ref_state.loss_scale) == 2.0**11
  np.testing.assert_allclose(float(state.grad_norm), float(ref_state.grad_norm), rtol=1e-5)


def test_pmap_without_axis_name_decides_per_device(lowering):
  """Documented user error, not detectable under pmap: each device decides alone."""
  n = jax.device_count()
  tx = _tx(None, lowering=lowering)
  grads = {"w": jnp.ones((n, 3)).at[6, 1].set(jnp.inf)}
  _, state = _pmap(tx.update, in_axes=(0, None))(grads, tx.init({"w": jnp.ones(3)}))
  finite = np.asarray(state.last_step_finite)
  assert not finite[6] and finite[:6].all() and finite[7:].all()


@pytest.mark.parametrize(
  "make_tx,backs_off",
  [
    (lambda a: optax_dls.no_loss_scale(optax.sgd(0.1), axis_name=a), False),
    (
      lambda a: optax_dls.loss_scaled(
        optax.sgd(0.1), optax_dls.amax_policy(init_scale=2.0**10), axis_name=a
      ),
      True,
    ),
  ],
  ids=["no_loss_scale", "amax_policy"],
)
def test_shard_map_statistics_are_global_and_replicated(mesh, make_tx, backs_off, lowering):
  """The stored norm (and an amax-driven scale) come from the whole gradient, the same on
  every device."""
  tx = make_tx(AXES)
  params = _params()
  grads = _grads(1.0)
  grads["w"] = grads["w"].at[7, 3].set(1e5)  # the largest entry, on one device only
  _, _state, per_device = _sharded_update(tx, mesh)(grads, tx.init(params), params)
  _, ref_state = jax.jit(make_tx(None).update)(grads, tx.init(params), params)
  per_device = np.asarray(per_device)
  np.testing.assert_allclose(per_device[:, 3], float(ref_state.grad_norm), rtol=1e-6)
  np.testing.assert_array_equal(per_device[:, 0], float(ref_state.loss_scale))
  # The amax policy backs off (before any overflow) because of the one large entry.
  assert (float(ref_state.loss_scale) < float(tx.init(params).loss_scale)) == backs_off


@pytest.mark.parametrize("bad", [False, True])
def test_an_axis_the_gradients_do_not_vary_over_may_be_named(mesh, bad, lowering):
  """Gradients sharded over "data" only, replicated over "model", with both axes named (as
  the coverage message and the docstring advise): the norm is the global one, counted once,
  and an inf in one shard skips every device."""
  specs = {"w": P("data"), "b": P()}
  tx = _tx(AXES, lowering=lowering)
  params = _params()
  state_specs = _state_specs(tx, tx.init(params), specs)

  def update(grads, state, params):
    _, state = tx.update(grads, state, params)
    return state.last_step_finite, state.grad_norm

  fn = jax.jit(
    jax.shard_map(update, mesh=mesh, in_specs=(specs, state_specs, specs), out_specs=(P(), P()))
  )
  grads = _grads(2.0**10)
  if bad:
    grads["w"] = grads["w"].at[5, 2].set(jnp.inf)
  put = functools.partial(_put, mesh)
  finite, norm = fn(put(grads, specs), put(tx.init(params), state_specs), put(params, specs))
  assert bool(finite) is not bad
  if not bad:
    flat = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)])
    np.testing.assert_allclose(float(norm), np.linalg.norm(flat) / 2.0**10, rtol=1e-5)
