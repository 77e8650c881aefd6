"""value_and_grad: an overflowing step is recomputed inside the same jitted step, no batch lost."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step, jit_xla_defaults
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array([0.25], jnp.float32)}


def _loss(dtype):
  """A float16 (or float32) linear model: large inputs overflow the float16 backward pass."""

  def loss(params, x):
    pred = x.astype(dtype) @ params["w"].astype(dtype) + params["b"].astype(dtype)
    return jnp.mean(jnp.square(pred)).astype(jnp.float32)

  return loss


LOSS16, LOSS32 = _loss(jnp.float16), _loss(jnp.float32)
SMALL = jnp.full((4, 3), 0.25)  # float16 gradients of 0.3 S at most: fine at the initial 2**15
BIG = jnp.full((4, 3), 2.0)  # float16 gradients of 13 S: they overflow for S >= 2**13


def _counted(inner):
  """``inner`` with the recomputation's counters chained first."""
  return optax.chain(optax_dls.recompute_stats(), inner)


def _tx(lowering="auto", **kw):
  return optax_dls.dynamic_loss_scale(
    _counted(optax.sgd(1e-3)),
    init_scale=2.0**15,
    growth_interval=1000,
    skip_lowering=lowering,
    **kw,
  )


def _tries(opt_state):
  return int(optax_dls.metrics(opt_state)["recompute_tries"])


def _step(tx, grad_fn):
  @jax.jit
  def step(params, opt_state, x):
    (loss, grads), opt_state = grad_fn(opt_state, params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def test_every_batch_is_applied_and_the_policy_sees_every_overflow(lowering):
  tx = _tx(lowering)
  step = _step(tx, optax_dls.value_and_grad(LOSS16, tx, max_tries=8))
  plain = _tx(lowering)
  plain_step = _step(plain, optax_dls.value_and_grad(LOSS16, plain, max_tries=0))
  params, state, pp, ps = PARAMS, tx.init(PARAMS), PARAMS, plain.init(PARAMS)
  for x in (SMALL, BIG, SMALL, BIG, BIG, SMALL):
    before = params
    params, state, _ = step(params, state, x)
    pp, ps, _ = plain_step(pp, ps, x)
    assert bool(state.last_step_finite) and not all(
      jax.tree.leaves(jax.tree.map(jnp.array_equal, params, before))
    )
  m, mp = optax_dls.metrics(state), optax_dls.metrics(ps)
  assert (
    int(m["skip_count"]) == 0 and int(mp["skip_count"]) >= 1
  )  # without recomputing, batches are lost
  assert int(m["recomputed_steps"]) >= 1 and int(m["recompute_tries"]) >= int(m["recomputed_steps"])
  # Each failed try backed the scale off, as a skipped step would have.
  assert float(m["loss_scale"]) == 2.0**15 / 2 ** int(m["recompute_tries"])
  assert step._cache_size() == 1


def test_a_recomputed_step_equals_a_step_run_directly_at_the_final_scale(lowering):
  tx = _tx(lowering)
  (loss, grads), state = jit_xla_defaults(optax_dls.value_and_grad(LOSS16, tx))(
    tx.init(PARAMS), PARAMS, BIG
  )
  final = float(optax_dls.find_state(state).loss_scale)
  assert final < 2.0**15 and _tries(state) >= 1
  direct = optax_dls.reset_scale(tx.init(PARAMS), final)
  (loss_d, grads_d), _ = jit_xla_defaults(optax_dls.value_and_grad(LOSS16, tx, max_tries=0))(
    direct, PARAMS, BIG
  )
  # The scales are powers of two: no rounding from the change of scale, the gradients are the same.
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_d)):
    np.testing.assert_array_equal(a, b)
  assert float(loss) == float(loss_d)
  new, _ = tx.update(grads, state, PARAMS)
  new_d, _ = tx.update(grads_d, direct._replace(policy_state=state.policy_state), PARAMS)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_d)):
    np.testing.assert_array_equal(a, b)


def _counting(loss_fn, seen):
  """``loss_fn`` that appends to ``seen`` each time a pass of it runs."""

  def counted(params, x):
    jax.debug.callback(lambda: seen.append(1))
    return loss_fn(params, x)

  return counted


def test_the_float32_last_resort_runs_only_when_every_try_overflowed(lowering):
  seen = []
  tx = _tx(lowering)
  fp32 = _counting(LOSS32, seen)
  grad_fn = jax.jit(optax_dls.value_and_grad(LOSS16, tx, fp32_fun=fp32, max_tries=2))
  (_, grads), state = grad_fn(tx.init(PARAMS), PARAMS, SMALL)
  jax.effects_barrier()
  assert seen == [] and _tries(state) == 0
  (_, grads), state = grad_fn(tx.init(PARAMS), PARAMS, BIG)  # float16 overflows down to 2**13
  jax.effects_barrier()
  m = optax_dls.metrics(state)
  assert seen == [1] and int(m["recompute_tries"]) == 3 and int(m["recomputed_steps"]) == 1
  assert float(state.loss_scale) == 2.0**12  # three overflows: 2**15 -> 2**12, the float32 scale
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  expected = jax.grad(lambda p: LOSS32(p, BIG) * 2.0**12)(PARAMS)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  _, state = tx.update(grads, state, PARAMS)
  assert bool(state.last_step_finite)


def test_when_every_try_overflows_the_step_is_skipped_as_usual():
  tx = _tx()
  (loss, grads), state = optax_dls.value_and_grad(LOSS16, tx, max_tries=1)(
    tx.init(PARAMS), PARAMS, BIG
  )
  assert np.isfinite(loss) and _tries(state) == 1 and float(state.loss_scale) == 2.0**14
  updates, state = tx.update(grads, state, PARAMS)
  assert (
    not bool(state.last_step_finite) and float(state.loss_scale) == 2.0**13
  )  # the last overflow
  assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
  assert _tries(state) == 1  # kept by the skipped step, as any inner state


# --- when another pass cannot help ------------------------------------------------------------

NAN = jnp.full((4, 3), jnp.nan)  # a bad batch: the loss itself is NaN
HUGE = jnp.full((4, 3), 3e3)  # a float16 forward pass that overflows: the loss is inf


def test_a_non_finite_loss_stops_at_once_and_the_skip_backs_off_once(lowering):
  seen = []
  tx = _tx(lowering)
  grad_fn = jax.jit(optax_dls.value_and_grad(_counting(LOSS16, seen), tx, max_tries=3))
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, NAN)
  jax.effects_barrier()
  assert np.isnan(loss) and len(seen) == 1 and _tries(state) == 0
  assert float(state.loss_scale) == 2.0**15  # no back-off for the retries: there were none
  _, state = tx.update(grads, state, PARAMS, loss=loss)
  assert not bool(state.last_step_finite) and float(state.loss_scale) == 2.0**14  # one back-off
  assert bool(optax_dls.metrics(state)["nonfinite_loss"])


def test_the_state_says_the_loss_was_not_finite_without_loss_passed_to_update(lowering):
  """value_and_grad has the loss: its state records it as the cause, which update keeps
  for that step, counting the overflow of each labelled group once."""
  tx = _tx(lowering, labels={"w": "weights", "b": "bias"})
  grad_fn = jax.jit(optax_dls.value_and_grad(LOSS16, tx, max_tries=3))
  (_, grads), state = grad_fn(tx.init(PARAMS), PARAMS, NAN)
  assert bool(optax_dls.metrics(state)["nonfinite_loss"])
  _, state = jax.jit(tx.update)(grads, state, PARAMS)  # no loss=
  m = optax_dls.metrics(state)
  assert bool(m["nonfinite_loss"]) and int(m["nonfinite_step"]) == 1
  assert float(m["loss_scale"]) == 2.0**14 and int(m["skip_count"]) == 1
  assert int(m["overflows/weights"]) == 1 and int(m["overflows/bias"]) == 1
  # The next step's own update does not inherit it.
  (_, grads), state = grad_fn(state, PARAMS, SMALL)
  _, state = jax.jit(tx.update)(grads, state, PARAMS)
  assert bool(state.last_step_finite) and int(optax_dls.metrics(state)["nonfinite_step"]) == 1
  (_, grads), state = grad_fn(state, PARAMS, BIG)  # an overflow of the gradients, recomputed
  _, state = jax.jit(tx.update)(grads, state, PARAMS)
  m = optax_dls.metrics(state)
  assert bool(state.last_step_finite) and not bool(m["nonfinite_loss"])


def test_a_clean_step_after_a_non_finite_loss_takes_one_pass(lowering):
  """The record of the earlier non-finite loss stays in the state; it says nothing of this one."""
  seen = []
  tx = _tx(lowering)
  grad_fn = optax_dls.value_and_grad(LOSS16, tx, fp32_fun=_counting(LOSS32, seen), max_tries=3)
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, NAN)
  _, state = tx.update(grads, state, PARAMS, loss=loss)
  assert bool(optax_dls.metrics(state)["nonfinite_loss"])
  jax.effects_barrier()
  seen.clear()
  before = _tries(state)  # the float32 pass of the NaN batch
  (loss, grads), state = grad_fn(state, PARAMS, SMALL)
  jax.effects_barrier()
  assert np.isfinite(loss) and seen == [] and _tries(state) == before  # no retry, no float32
  _, state = tx.update(grads, state, PARAMS, loss=loss)
  assert bool(state.last_step_finite)


def test_a_recomputed_step_records_where_its_overflow_came_from():
  tx = _tx()
  grad_fn = optax_dls.value_and_grad(LOSS16, tx, max_tries=8)
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, BIG)
  _, state = tx.update(grads, state, PARAMS, loss=loss)
  m = optax_dls.metrics(state)
  assert bool(state.last_step_finite) and _tries(state) >= 1 and not bool(m["nonfinite_loss"])
  assert int(m["nonfinite_step"]) == 1 and optax_dls.nonfinite_leaves(state, PARAMS)


def test_a_non_finite_loss_still_gets_the_float32_pass_at_the_same_scale():
  seen = []
  tx = _tx()
  grad_fn = optax_dls.value_and_grad(LOSS16, tx, fp32_fun=_counting(LOSS32, seen), max_tries=3)
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, HUGE)
  jax.effects_barrier()
  assert seen == [1] and _tries(state) == 1 and float(state.loss_scale) == 2.0**15
  assert np.isfinite(loss) and float(loss) == float(LOSS32(PARAMS, HUGE))
  expected = jax.grad(lambda p: LOSS32(p, HUGE) * 2.0**15)(PARAMS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, expected)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_dls.static_loss_scale(_counted(optax.sgd(1e-3)), 2.0**15),
    lambda: _tx(min_scale=2.0**15),  # at the floor already
    lambda: _tx(hysteresis=3),  # the first overflows spend the hysteresis, not the scale
  ],
  ids=["static", "floor", "hysteresis"],
)
def test_a_scale_that_cannot_move_stops_the_retries(make):
  seen = []
  tx = make()
  grad_fn = jax.jit(optax_dls.value_and_grad(_counting(LOSS16, seen), tx, max_tries=8))
  (_, grads), state = grad_fn(tx.init(PARAMS), PARAMS, BIG)
  jax.effects_barrier()
  assert len(seen) == 1 and _tries(state) == 0 and float(state.loss_scale) == 2.0**15
  _, state = tx.update(grads, state, PARAMS)
  assert not bool(state.last_step_finite)  # skipped, as without the recomputation


def test_a_scale_that_cannot_move_still_gets_the_float32_pass():
  seen = []
  tx = optax_dls.static_loss_scale(_counted(optax.sgd(1e-3)), 2.0**15)
  grad_fn = optax_dls.value_and_grad(LOSS16, tx, fp32_fun=_counting(LOSS32, seen), max_tries=8)
  (_, grads), state = grad_fn(tx.init(PARAMS), PARAMS, BIG)
  jax.effects_barrier()
  assert seen == [1] and _tries(state) == 1
  _, state = tx.update(grads, state, PARAMS)
  assert bool(state.last_step_finite)  # float32 gradients at 2**15 fit


def test_hysteresis_counts_each_failed_try_once_the_scale_moves():
  tx = _tx(hysteresis=2)
  grad_fn = optax_dls.value_and_grad(LOSS16, tx, max_tries=8)
  (_, grads), state = grad_fn(tx.init(PARAMS), PARAMS, BIG)
  # The first overflow spends the hysteresis and leaves the scale: no pass at the same scale.
  assert _tries(state) == 0 and float(state.loss_scale) == 2.0**15
  _, state = tx.update(grads, state, PARAMS)
  assert not bool(state.last_step_finite) and int(state.policy_state.hysteresis_left) == 1
  # The next overflow backs off (no hysteresis left): recomputed at 2**14 and 2**13, fine at 2**12.
  (_, grads), state = grad_fn(state, PARAMS, BIG)
  assert _tries(state) == 3 and float(state.loss_scale) == 2.0**12
  assert int(state.policy_state.growth_tracker) == 0


def test_has_aux_argnums_and_value():
  tx = _tx()

  def loss(x, params):
    return LOSS16(params, x), {"n": x.shape[0]}

  grad_fn = optax_dls.value_and_grad(loss, tx, argnums=1, has_aux=True)
  ((value, aux), grads), _ = grad_fn(tx.init(PARAMS), BIG, PARAMS)
  assert aux == {"n": 4} and float(value) == float(LOSS16(PARAMS, BIG))
  assert jax.tree.structure(grads) == jax.tree.structure(PARAMS)


def test_under_shard_map_every_device_takes_the_same_number_of_tries(lowering):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  tx = _tx(lowering, axis_name="data")
  state = tx.init(PARAMS)
  spec = jax.tree.map(lambda _: P(), state)

  def local(x, state):
    (_, grads), state = optax_dls.value_and_grad(LOSS16, tx)(state, PARAMS, x)
    grads = jax.lax.pmean(grads, "data")
    _, state = tx.update(grads, state, PARAMS)
    return optax_dls.metrics(state)["recompute_tries"][None], state.loss_scale[None]

  f = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P("data"), spec), out_specs=(P("data"), P("data")))
  )
  x = jnp.full((8, 3), 0.25).at[5].set(2.0)  # only device 5's rows overflow
  tries, scales = f(x, state)
  assert len(set(np.asarray(tries).tolist())) == 1 and int(tries[0]) >= 1
  assert len(set(np.asarray(scales).tolist())) == 1


def test_under_jit_with_named_sharding():
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.full((8, 3), 2.0), NamedSharding(mesh, P("data")))
    tx = _tx()
    step = _step(tx, optax_dls.value_and_grad(LOSS16, tx))
    _, state, _ = step(PARAMS, tx.init(PARAMS), x)
  assert bool(state.last_step_finite) and int(optax_dls.metrics(state)["recomputed_steps"]) == 1


MATRIX = {"w": jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(8, 3), "b": jnp.zeros(3)}


def _matrix_loss(params, x):
  """float16 ``x @ w.T``: the gradient of ``w`` is a product, so its layout is XLA's to choose."""
  y = (
    x.astype(jnp.float16) @ params["w"].T.astype(jnp.float16)
    + params["b"].astype(jnp.float16)[None, :1]
  )
  return jnp.mean(jnp.square(y)).astype(jnp.float32)


def _matrix_step(tx):
  def step(params, opt_state, x):
    (_, grads), opt_state = optax_dls.value_and_grad(_matrix_loss, tx)(opt_state, params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  return step


def test_matrix_gradients_keep_their_sharding_and_values_under_explicit_axes_and_vmap():
  x = jnp.full((4, 3), 4.0)  # overflows float16 at 2**15: recomputed at a lower scale
  tx = _tx()
  params, state, _ = jax.jit(_matrix_step(tx))(MATRIX, tx.init(MATRIX), x)
  assert _tries(state) >= 1 and bool(state.last_step_finite)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    sharded = {
      "w": jax.device_put(MATRIX["w"], NamedSharding(mesh, P("data", None))),
      "b": MATRIX["b"],
    }
    p_sh, s_sh, g_sh = jax.jit(_matrix_step(tx))(sharded, tx.init(sharded), x)
  for out in (g_sh["w"], p_sh["w"]):
    assert out.sharding.is_equivalent_to(sharded["w"].sharding, 2)
  assert _tries(s_sh) == _tries(state)
  np.testing.assert_allclose(p_sh["w"], params["w"], rtol=2e-7)
  batched = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), MATRIX)
  p_v, s_v, _ = jax.vmap(_matrix_step(tx), in_axes=(0, 0, None))(
    batched, jax.vmap(tx.init)(batched), x
  )
  np.testing.assert_allclose(p_v["w"][0], params["w"], rtol=2e-7)
  assert np.asarray(optax_dls.metrics(s_v)["recompute_tries"]).min() >= 1


def test_a_recomputing_step_exports_with_the_layout_constraint_allowed():
  """On the CPU the gradients' layout pin is a ``LayoutConstraint`` custom call, which
  ``jax.export`` accepts once told to (as the docstring says); the exported step
  computes what the jitted one does."""
  from jax import export

  x = jnp.full((4, 3), 4.0)
  tx = _tx()
  step = jax.jit(_matrix_step(tx))
  allow = [export.DisabledSafetyCheck.custom_call("LayoutConstraint")]
  exported = export.export(step, disabled_checks=allow)(MATRIX, tx.init(MATRIX), x)
  for a, b in zip(
    jax.tree.leaves(exported.call(MATRIX, tx.init(MATRIX), x)),
    jax.tree.leaves(step(MATRIX, tx.init(MATRIX), x)),
  ):
    np.testing.assert_array_equal(a, b)


def test_with_gradient_accumulation_each_micro_batch_is_recomputed():
  tx = optax_dls.dynamic_loss_scale(
    optax.MultiSteps(_counted(optax.sgd(1e-3)), every_k_schedule=2),
    init_scale=2.0**15,
    growth_interval=1000,
  )
  step = _step(tx, optax_dls.value_and_grad(LOSS16, tx))
  params, state = PARAMS, tx.init(PARAMS)
  for x in (SMALL, BIG, BIG, SMALL):
    params, state, _ = step(params, state, x)
  m = optax_dls.metrics(state)
  # The first BIG micro-batch was recomputed (at 2**12, where the second fits too): none skipped.
  assert (
    int(m["skip_count"]) == 0
    and int(m["recomputed_steps"]) == 1
    and float(m["loss_scale"]) == 2.0**12
  )
  assert int(optax_dls.find_state(state).inner_state.gradient_step) == 2  # two applied windows


def test_no_loss_scale_takes_one_pass_and_never_multiplies_the_loss():
  tx = optax_dls.no_loss_scale(_counted(optax.sgd(1e-3)))
  grad_fn = jit_xla_defaults(optax_dls.value_and_grad(LOSS32, tx))
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, SMALL)
  assert _tries(state) == 0
  plain_loss, plain_grads = jit_xla_defaults(jax.value_and_grad(LOSS32))(PARAMS, SMALL)
  assert float(loss) == float(plain_loss)
  jax.tree.map(np.testing.assert_array_equal, grads, plain_grads)
  # A scale restored from a scaled run multiplies the loss once; the update divides it out
  # and leaves S = 1.
  forged = optax_dls.find_state(state)._replace(loss_scale=jnp.float32(8.0))
  (_, forged_grads), forged = grad_fn(forged, PARAMS, SMALL)
  jax.tree.map(lambda g, p: np.testing.assert_array_equal(g, 8 * p), forged_grads, plain_grads)
  updates, settled = tx.update(forged_grads, forged, PARAMS)
  plain_updates, _ = tx.update(plain_grads, state, PARAMS)
  jax.tree.map(np.testing.assert_array_equal, updates, plain_updates)
  assert float(settled.loss_scale) == 1.0


@pytest.mark.parametrize(
  "kw, error, match",
  [
    ({"max_tries": -1}, ValueError, "max_tries"),
    ({"max_tries": 1.5}, TypeError, "max_tries"),
    ({"fp32_fun": 3}, TypeError, "fp32_fun"),
    ({"has_aux": 1}, TypeError, "has_aux"),
    ({"argnums": "0"}, TypeError, "argnums"),
    ({"argnums": (0, 0)}, ValueError, r"argnums=\(0, 0\)"),
  ],
)
def test_bad_arguments_are_named(kw, error, match):
  with pytest.raises(error, match=match):
    optax_dls.value_and_grad(LOSS16, _tx(), **kw)


def test_argnums_beyond_the_arguments_is_named_when_called():
  tx = _tx()
  grad_fn = optax_dls.value_and_grad(LOSS16, tx, argnums=5)
  with pytest.raises(TypeError, match=r"argnums=5 asks for positional argument 5 .* called with 2"):
    grad_fn(tx.init(PARAMS), PARAMS, SMALL)


def test_tx_must_be_the_loss_scaled_transformation():
  with pytest.raises(TypeError, match="tx"):
    optax_dls.value_and_grad(LOSS16, optax.chain(_tx()))
  with pytest.raises(TypeError, match="fun"):
    optax_dls.value_and_grad(None, _tx())


def test_fun_may_take_any_keyword_scale_and_opt_state_included():
  tx = _tx()

  def loss(params, x, *, scale, opt_state):
    return LOSS16(params, x) * scale + opt_state

  grad_fn = optax_dls.value_and_grad(loss, tx)
  (value, grads), _ = grad_fn(tx.init(PARAMS), PARAMS, SMALL, scale=0.5, opt_state=1.0)
  assert float(value) == float(LOSS16(PARAMS, SMALL) * 0.5 + 1.0)
  expected = jax.grad(lambda p: LOSS16(p, SMALL) * 0.5 * 2.0**15)(PARAMS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3), grads, expected)


def test_swapped_arguments_are_named():
  tx = _tx()
  grad_fn = optax_dls.value_and_grad(LOSS16, tx)
  with pytest.raises(
    ValueError,
    match=r"grad_fn takes the optimizer state first .* grad_fn\(opt_state, \*args\).*got a dict\. "
    r"The second argument holds one: the arguments look swapped",
  ):
    grad_fn(PARAMS, tx.init(PARAMS), SMALL)
  with pytest.raises(ValueError, match=r"grad_fn\(opt_state, \*args\).*got a dict\.$"):
    grad_fn(PARAMS, SMALL)


# --- recompute_stats --------------------------------------------------------------------------


def test_without_recompute_stats_it_recomputes_and_counts_nothing():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1e-3), init_scale=2.0**15)
  (_, _), state = optax_dls.value_and_grad(LOSS16, tx)(tx.init(PARAMS), PARAMS, BIG)
  assert float(state.loss_scale) == 2.0**12  # recomputed all the same
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(PARAMS))


def test_recompute_stats_is_an_identity_and_counts_saturate():
  stats = optax_dls.recompute_stats()
  state = stats.init(PARAMS)
  assert type(state).__name__ == "RecomputeState" and [int(x) for x in state] == [0, 0]
  assert [x.dtype for x in state] == [jnp.int32, jnp.int32]
  updates, same = stats.update(PARAMS, state, PARAMS)
  assert updates is PARAMS and same is state
  tx = _tx()
  start = tx.init(PARAMS)
  inner = (start.inner_state[0]._replace(recompute_tries=jnp.int32(2**31 - 2)),) + tuple(
    start.inner_state[1:]
  )
  (_, _), state = optax_dls.value_and_grad(LOSS16, tx)(
    start._replace(inner_state=inner), PARAMS, BIG
  )
  m = optax_dls.metrics(state)
  assert int(m["recompute_tries"]) == 2**31 - 1 and int(m["recomputed_steps"]) == 1


def test_two_recompute_stats_are_refused():
  tx = optax_dls.dynamic_loss_scale(
    optax.chain(optax_dls.recompute_stats(), optax_dls.recompute_stats(), optax.sgd(1e-3))
  )
  with pytest.raises(ValueError, match="more than one recompute_stats"):
    optax_dls.value_and_grad(LOSS16, tx)(tx.init(PARAMS), PARAMS, BIG)


def test_under_shard_map_a_non_finite_loss_on_one_device_stops_every_device():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  tx = _tx(axis_name="data")
  state = tx.init(PARAMS)
  spec = jax.tree.map(lambda _: P(), state)

  def local(x, state):
    _, state = optax_dls.value_and_grad(LOSS16, tx, max_tries=5)(state, PARAMS, x)
    return optax_dls.metrics(state)["recompute_tries"][None], state.loss_scale[None]

  f = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(P("data"), spec), out_specs=(P("data"), P("data")))
  )
  x = jnp.full((8, 3), 2.0).at[5].set(jnp.nan)  # every device overflows; device 5's loss is NaN
  tries, scales = f(x, state)
  assert np.asarray(tries).tolist() == [0] * 8 and np.asarray(scales).tolist() == [2.0**15] * 8


def _with_data_term(loss_fn):
  """``loss_fn`` plus a term of the batch alone (no parameter in it): ``-inf`` for a batch
  holding a 0, so that the loss is not finite while every gradient is."""
  return lambda params, x, bad: loss_fn(params, x) + jnp.log(bad)


def test_a_non_finite_loss_with_finite_gradients_skips_the_next_update(lowering):
  """value_and_grad records the loss as the cause; the next update skips and backs off once,
  even though the gradients it is handed are finite, and metrics count the skip."""
  tx = _tx(lowering)
  grad_fn = jax.jit(optax_dls.value_and_grad(_with_data_term(LOSS16), tx, max_tries=3))
  (loss, grads), state = grad_fn(tx.init(PARAMS), PARAMS, SMALL, jnp.float32(0.0))
  assert np.isneginf(loss) and optax_dls.all_finite(grads)
  for step in (jax.jit(tx.update), jax.jit(functools.partial(apply_step, tx))):
    _, after = step(grads, state, PARAMS)
    m = optax_dls.metrics(after)
    assert bool(m["skipped"]) and int(m["skip_count"]) == 1 and bool(m["nonfinite_loss"])
    assert float(m["loss_scale"]) == 2.0**14 and int(m["nonfinite_step"]) == 1
  updates, after = jax.jit(tx.update)(grads, state, PARAMS)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))  # nothing applied
  # The next step, with a finite loss, is not skipped for the earlier record.
  (loss, grads), after = grad_fn(after, PARAMS, SMALL, jnp.float32(1.0))
  _, after = jax.jit(tx.update)(grads, after, PARAMS)
  assert bool(after.last_step_finite) and int(optax_dls.metrics(after)["skip_count"]) == 1


def test_aux_of_any_pytree_comes_back_as_jax_value_and_grad_gives_it():
  """Strings, Python numbers and flags in aux and among the arguments pass through, with
  retries and the float32 pass too."""

  def loss(params, x, mode="train", *, flag=True):
    value = LOSS32(params, x)
    return value, {"mode": mode, "n": 3, "flag": flag, "sum": jnp.sum(x)}

  tx = _tx()
  grad_fn = optax_dls.value_and_grad(loss, tx, has_aux=True, max_tries=2, fp32_fun=loss)
  ((value, aux), grads), _ = grad_fn(tx.init(PARAMS), PARAMS, SMALL, "eval", flag=False)
  (ref, ref_aux), ref_grads = jax.value_and_grad(loss, has_aux=True)(
    PARAMS, SMALL, "eval", flag=False
  )
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g / 2.0**15, r, rtol=1e-6), grads, ref_grads)
  assert aux["mode"] == "eval" and aux["n"] == 3 and aux["flag"] is False
  np.testing.assert_array_equal(aux["sum"], ref_aux["sum"])
  np.testing.assert_array_equal(value, ref)


def test_static_arguments_under_jit_pass_through_as_with_jax_value_and_grad():
  """A Python flag and a string, static under jit (positional and keyword), reach fun as
  they are; aux holds numbers made from them."""

  def loss(params, x, mode, *, double=False):
    value = LOSS32(params, x) * (2.0 if double else 1.0)
    return value, {"chars": len(mode), "double": double}

  tx = _tx()
  grad_fn = optax_dls.value_and_grad(loss, tx, has_aux=True)
  jitted = jax.jit(grad_fn, static_argnums=3, static_argnames="double")
  ((value, aux), grads), _ = jitted(tx.init(PARAMS), PARAMS, SMALL, "eval", double=True)
  (ref, _), ref_grads = jax.value_and_grad(loss, has_aux=True)(PARAMS, SMALL, "eval", double=True)
  np.testing.assert_allclose(value, ref, rtol=1e-6)
  assert int(aux["chars"]) == 4 and bool(aux["double"])
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g / 2.0**15, r, rtol=1e-6), grads, ref_grads)
