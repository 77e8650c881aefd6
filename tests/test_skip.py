"""Skip exactness: a non-finite step leaves no trace but the loss scale and the counters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls

PARAMS = {"a": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array([[1.0, 3.0]], jnp.float32)}
KEYS = jax.random.split(jax.random.key(0), 4)
GOOD = [jax.tree.map(lambda p, i=i: jax.random.normal(KEYS[i], p.shape), PARAMS) for i in range(4)]
BAD = [dict(GOOD[0], b=GOOD[0]["b"].at[0, 1].set(v)) for v in (jnp.nan, jnp.inf, -jnp.inf)]

INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "adam_schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, 10)),
    "chain_schedule": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_schedule(optax.linear_schedule(-1e-2, -1e-3, 10))),
}


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)] + [str(jax.tree.structure(tree))]


@pytest.mark.parametrize("name", sorted(INNERS))
def test_skip_is_exact_and_leaves_no_trace(name):
  # growth_interval large: S only moves on overflows, and stays a power of two, so
  # g * S / S == g exactly and both runs feed the inner optimizer the same values.
  tx = optax_dls.dynamic_loss_scale(INNERS[name](), init_scale=2.0**10, growth_interval=1000,
                                    alerts=False)

  @jax.jit
  def step(params, state, g):
    g = jax.tree.map(lambda x: x * optax_dls.loss_scale(state), g)
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
