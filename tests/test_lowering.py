"""The skip: exact under both lowerings, for any inner optimizer, any sharding and any scale."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import XLA_DEFAULTS, apply_step, requires_optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

PARAMS = {"a": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array([[1.0, 3.0]], jnp.float32)}
KEYS = jax.random.split(jax.random.key(0), 4)
GOOD = [jax.tree.map(lambda p, i=i: jax.random.normal(KEYS[i], p.shape), PARAMS) for i in range(4)]
BAD = [dict(GOOD[0], b=GOOD[0]["b"].at[0, 1].set(v)) for v in (jnp.nan, jnp.inf, -jnp.inf)]

INNERS = {
  "adam": lambda: optax.adam(1e-2),
  "adam_schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, 10)),
  "chain_schedule": lambda: optax.chain(
    optax.scale_by_adam(), optax.scale_by_schedule(optax.linear_schedule(-1e-2, -1e-3, 10))
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
}


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)] + [str(jax.tree.structure(tree))]


def _types(tree):
  return [
    (x.shape, x.dtype, jax.typeof(x).weak_type, str(jax.typeof(x).sharding.spec))
    for x in jax.tree.leaves(tree)
  ]


@pytest.mark.parametrize("name", sorted(INNERS))
def test_skip_is_exact_and_leaves_no_trace(name, lowering):
  # growth_interval large: S only moves on overflows, and stays a power of two, so
  # g * S / S == g exactly and both runs feed the inner optimizer the same values.
  tx = optax_dls.dynamic_loss_scale(
    INNERS[name](), init_scale=2.0**10, growth_interval=1000, skip_lowering=lowering
  )

  @jax.jit
  def step(params, state, g):
    g = jax.tree.map(lambda x: x * optax_dls.find_state(state).loss_scale, g)
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state, updates

  def run(seq):
    params, state = PARAMS, tx.init(PARAMS)
    for g in seq:
      before_params, before_inner = params, state.inner_state
      params, state, updates = step(params, state, g)
      if any(g is b for b in BAD):
        for u in jax.tree.leaves(updates):
          assert u.dtype == jnp.float32 and not bool(jnp.any(u != 0))
        assert _bits(params) == _bits(before_params)
        assert _bits(state.inner_state) == _bits(before_inner)
    return params, state

  clean_params, clean_state = run(GOOD)
  bad_params, bad_state = run(GOOD[:2] + BAD + GOOD[2:])
  assert _bits(bad_params) == _bits(clean_params)
  assert _bits(bad_state.inner_state) == _bits(clean_state.inner_state)
  assert int(bad_state.num_skipped) == 3 and float(bad_state.loss_scale) == 2.0**7
  counts = [c for c in jax.tree.leaves(bad_state.inner_state) if c.dtype == jnp.int32]
  assert counts and all(int(c) == 4 for c in counts)  # Adam's and the schedule's counts
  assert step._cache_size() == 1


def test_both_lowerings_give_identical_results():
  seq = GOOD[:2] + BAD[:1] + GOOD[2:] + BAD[1:] + GOOD
  out = {}
  for lowering in ("cond", "where"):
    tx = optax_dls.dynamic_loss_scale(
      optax.adamw(1e-2), init_scale=2.0**3, growth_interval=2, skip_lowering=lowering
    )
    params, state = PARAMS, tx.init(PARAMS)
    update = jax.jit(tx.update)
    fused = jax.jit(lambda g, s, p, tx=tx: apply_step(tx, g, s, p))
    for g in seq:
      updates, _ = update(g, state, params)
      params, state = fused(g, state, params)
    out[lowering] = _bits((params, state, updates))
  assert out["cond"] == out["where"]


@requires_optax(
  "0.2.8",
  "inject_hyperparams(adam) widens float16 moments to float32 on the first "
  "update only from optax 0.2.8; before, there is no widening to hold fixed",
)
@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
def test_mixed_f16_f32_params_with_an_inner_state_that_widens(lowering, eager):
  """optax promotes the float16 moments to float32 on the first update under inject_hyperparams."""
  params = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array([1.0, -2.0], jnp.float16)}
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  tx = optax_dls.dynamic_loss_scale(
    inner, init_scale=4.0, growth_interval=1000, skip_lowering=lowering
  )
  bare_state = inner.init(params)
  bare_updates, bare_after = inner.update(params, bare_state, params)
  assert _types(bare_state) != _types(bare_after)  # the inner optimizer does widen its state
  update = tx.update if eager else jax.jit(tx.update)
  state = tx.init(params)
  assert _types(state.inner_state) == _types(bare_after)  # widened from init on: a fixed point
  good = jax.tree.map(lambda p: (p * 4).astype(p.dtype), params)
  bad = dict(good, b=good["b"].at[0].set(jnp.inf))
  seen = [_types(state)]
  for g in (bad, good, bad, good):
    before = state.inner_state
    updates, state = update(g, state, params)
    seen.append(_types(state))
    if g is bad:
      assert _bits(state.inner_state) == _bits(before)
      assert _types(updates) == _types(bare_updates)
  assert all(t == seen[0] for t in seen)
  assert int(state.num_skipped) == 2 and int(state.inner_state.count) == 2
  if not eager:
    assert update._cache_size() == 1


def _mesh(axis_type, shape=(8,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


LAYOUTS = {  # name -> (mesh shape, axis names, spec of each parameter leaf)
  "data_parallel": ((8,), ("data",), {"w": P("data"), "m": P("data", None), "r": P()}),
  "fsdp": ((2, 4), ("data", "model"), {"w": P("model"), "m": P("data", "model"), "r": P()}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("eager", [False, True], ids=["jit", "eager"])
def test_sharded_skip_matches_the_applied_step_in_type(layout, axis_type, eager, lowering):
  shape, names, specs = LAYOUTS[layout]
  mesh = _mesh(axis_type, shape, names)
  base = {"w": jnp.arange(8.0), "m": jnp.ones((8, 4)), "r": jnp.array([1.0, 2.0])}
  with jax.set_mesh(mesh):
    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in t.items()}
    params = put(base)
    good, bad = (
      put(jax.tree.map(lambda x: x * 2, base)),
      put(dict(base, w=base["w"].at[3].set(jnp.nan))),
    )
    tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0, skip_lowering=lowering)
    update = tx.update if eager else jax.jit(tx.update)
    fused = lambda g, s, p: apply_step(tx, g, s, p)
    fused = fused if eager else jax.jit(fused)
    state = tx.init(params)
    applied, s1 = update(good, state, params)
    skipped, s2 = update(bad, state, params)
    assert not bool(s2.last_step_finite) and bool(s1.last_step_finite)
    assert _types(skipped) == _types(applied) and _types(s2) == _types(s1) == _types(state)
    if axis_type == AxisType.Explicit:
      assert [t[3] for t in _types(applied)] == [
        t[3] for t in _types(params)
      ]  # sharded like params
      assert "'data'" in _types(applied)[0][3] and "'data'" not in _types(applied)[1][3]  # m, r
    assert not any(np.any(np.asarray(u)) for u in jax.tree.leaves(skipped))
    new_params, _ = fused(bad, state, params)
    assert _bits(new_params) == _bits(params) and _types(new_params) == _types(params)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 0.0, -1.0, 1e-45], ids=str)
def test_an_invalid_loss_scale_never_lets_an_update_through(value, lowering):
  init = 2.0**5
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=init, skip_lowering=lowering)
  params = {"w": jnp.array([1.0, 2.0])}
  state = tx.init(params)
  state = state._replace(loss_scale=jnp.asarray(value, jnp.float32))  # a corrupted checkpoint, say
  before = state.inner_state
  updates, new = jax.jit(tx.update)({"w": jnp.array([1.0, -1.0])}, state, params)
  assert not bool(new.last_step_finite) and int(new.num_skipped) == 1
  assert not np.any(np.asarray(updates["w"]))
  assert _bits(new.inner_state) == _bits(before)
  assert float(new.loss_scale) == init  # back to the policy's initial scale
  new_params, _ = jax.jit(lambda g, s, p: apply_step(tx, g, s, p))(
    {"w": jnp.ones(2)}, state, params
  )
  assert _bits(new_params) == _bits(params)
  # The next step runs normally from there.
  updates, new = jax.jit(tx.update)({"w": jnp.array([init, -init])}, new, params)
  np.testing.assert_array_equal(updates["w"], [-1.0, 1.0])


def test_a_policy_that_returns_an_invalid_scale_is_caught_and_clamped():
  def init():
    return jnp.float32(4.0), jnp.zeros([], jnp.int32)

  def update(scale, n, stats):  # misbehaves: NaN after the first step, then out of range
    bad = jnp.where(n == 0, jnp.nan, 2.0**60)
    return bad.astype(jnp.float32), n + 1

  policy = optax_dls.LossScalePolicy(init, update, max_scale=2.0**20)
  tx = optax_dls.loss_scaled(optax.sgd(1.0), policy)
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.array([4.0])}, state, params)
  assert bool(state.last_step_finite) and float(state.loss_scale) == 4.0  # NaN: restarted
  updates, state = update({"w": jnp.array([4.0])}, state, params)
  assert bool(state.last_step_finite) and float(updates["w"][0]) == -1.0  # 4 / S, applied
  assert float(state.loss_scale) == 2.0**20  # 2**60 clamped to max_scale
  state = state._replace(loss_scale=jnp.float32(jnp.nan))  # a corrupted checkpoint's scale
  updates, state = update({"w": jnp.array([4.0])}, state, params)
  assert not bool(state.last_step_finite) and not np.any(np.asarray(updates["w"]))
  assert float(state.loss_scale) == 4.0  # skipped, restarted at the initial scale


def _compiled(tx):
  params = {"w": jnp.ones(4)}
  lowered = jax.jit(tx.update).lower(params, tx.init(params), params)
  return lowered.compile(compiler_options=XLA_DEFAULTS).as_text()


def _temp_bytes(tx, n=1 << 16, leaves=8):
  """Scratch memory of a jitted, donated ``tx.update`` + ``optax.apply_updates`` step on
  ``leaves`` leaves of ``n`` float32 entries each."""
  params = {f"p{i}": jnp.ones(n) for i in range(leaves)}

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), params)
  return lowered.compile(compiler_options=XLA_DEFAULTS).memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what XLA's CPU backend compiles")
def test_auto_takes_the_cond_on_the_cpu():
  build = lambda k: optax_dls.dynamic_loss_scale(optax.adam(1e-3), skip_lowering=k)
  assert "conditional" in _compiled(build("cond")) and "conditional" not in _compiled(
    build("where")
  )
  assert "conditional" in _compiled(build("auto"))  # compiled for the CPU
  # The cond skip runs the optimizer only on a finite step; "where" runs it always and
  # selects at the end, which XLA's CPU backend pays for with copies of the state.
  leaf_bytes = 4 << 16
  assert _temp_bytes(build("where")) >= 8 * leaf_bytes


@pytest.mark.parametrize("bad, error", [("fast", ValueError), (None, TypeError), (1, TypeError)])
def test_bad_skip_lowering_names_the_argument(bad, error):
  with pytest.raises(error, match="skip_lowering"):
    optax_dls.dynamic_loss_scale(optax.sgd(1.0), skip_lowering=bad)
