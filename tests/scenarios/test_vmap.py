"""An ensemble under vmap: one loss scale per member, or one shared scale with an axis name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls

MEMBERS = 4
# finite (True) / non-finite (False) per step and member: member 2 overflows
# alone at step 0, member 0 at step 2, member 3 twice.
PATTERN = np.array(
  [
    [True, True, False, True],
    [True, True, True, False],
    [False, True, True, False],
    [True, True, True, True],
  ]
)


def _tx(axis_name=None, lowering="auto"):
  return optax_dls.dynamic_loss_scale(
    optax.adam(1e-2),
    init_scale=2.0**10,
    growth_interval=2,
    axis_name=axis_name,
    skip_lowering=lowering,
  )


def _grads(step, member, scale, finite):
  g = jnp.sin(jnp.arange(6.0) + 3 * step + member) * scale
  return {"w": g if finite else g.at[member].set(jnp.nan if step % 2 else jnp.inf)}


def _ensemble_params():
  return {"w": jnp.arange(MEMBERS * 6.0).reshape(MEMBERS, 6) / 10}


def test_each_member_skips_and_scales_on_its_own(lowering):
  tx = _tx(lowering=lowering)
  params = _ensemble_params()
  state = jax.vmap(tx.init)(params)
  update = jax.jit(jax.vmap(tx.update))

  solo = [
    (jax.tree.map(lambda x, m=m: x[m], params), tx.init(jax.tree.map(lambda x, m=m: x[m], params)))
    for m in range(MEMBERS)
  ]
  solo_update = jax.jit(tx.update)
  for step, finite in enumerate(PATTERN):
    scales = np.asarray(state.loss_scale)
    grads = [_grads(step, m, scales[m], finite[m]) for m in range(MEMBERS)]
    before = params
    updates, state = update(jax.tree.map(lambda *g: jnp.stack(g), *grads), state, params)
    params = optax.apply_updates(params, updates)

    np.testing.assert_array_equal(np.asarray(state.last_step_finite), finite)
    moved = np.asarray(jnp.any(params["w"] != before["w"], axis=1))
    np.testing.assert_array_equal(moved, finite)  # skipped members keep their parameters

    # Oracle: each member trained alone, without vmap.
    for m in range(MEMBERS):
      p, s = solo[m]
      u, s = solo_update(grads[m], s, p)
      solo[m] = (optax.apply_updates(p, u), s)

  for m, (p, s) in enumerate(solo):
    np.testing.assert_allclose(np.asarray(params["w"][m]), np.asarray(p["w"]), rtol=1e-6, atol=1e-7)
    assert float(state.loss_scale[m]) == float(s.loss_scale)
    assert int(state.num_skipped[m]) == int(s.num_skipped) == int((~PATTERN[:, m]).sum())
    np.testing.assert_array_equal(
      np.asarray(state.inner_state[0].count[m]), np.asarray(s.inner_state[0].count)
    )
  # The scales really did move apart: 2**10 -> grown, backed off, or both.
  assert len(set(np.asarray(state.loss_scale).tolist())) > 1


def test_axis_name_makes_members_share_one_decision(lowering):
  tx = _tx("ensemble", lowering=lowering)
  params = _ensemble_params()
  state = jax.vmap(tx.init)(params)
  update = jax.jit(jax.vmap(tx.update, axis_name="ensemble"))
  grads = jnp.stack([_grads(0, m, 2.0**10, m != 2)["w"] for m in range(MEMBERS)])
  updates, state = update({"w": grads}, state, params)
  np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)
  np.testing.assert_array_equal(np.asarray(state.loss_scale), np.full(MEMBERS, 2.0**9))
  np.testing.assert_array_equal(np.asarray(state.num_skipped), np.ones(MEMBERS))
