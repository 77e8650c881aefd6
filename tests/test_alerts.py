"""Alerts: one logging warning per episode of consecutive skips, and one when stuck at min_scale."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

PARAMS = {"w": jnp.zeros((8, 2), jnp.float32)}
F, I = 1.0, float("inf")


def _grads(kind):
  return {"w": jnp.full((8, 2), kind, jnp.float32)}


def _warnings(caplog):
  jax.effects_barrier()
  return [r for r in caplog.records if r.name == "optax_dls" and r.levelno == logging.WARNING]


def _run(tx, kinds, update=None, put=lambda x: x):
  update = update or jax.jit(tx.update)
  state = put(tx.init(PARAMS))
  for k in kinds:
    _, state = update(put(_grads(k)), state, put(PARAMS))
  return state


def test_one_warning_per_episode_with_step_scale_and_count(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10, alert_after=3, alerts=True)
  _run(tx, [F, I, I, I, I, I, F, I, I, I])
  recs = _warnings(caplog)
  assert len(recs) == 2, [r.getMessage() for r in recs]
  first, second = (r.getMessage() for r in recs)
  assert "3 consecutive skipped steps" in first and "step 3" in first and "loss scale now 128" in first
  assert "step 9" in second and f"loss scale now {2**10 // 2**8}" in second  # 8 backoffs so far


def test_no_warning_below_threshold(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), alert_after=4, alerts=True)
  _run(tx, [I, I, I, F, I, I, I, F])
  assert _warnings(caplog) == []


def test_stuck_at_min_scale_warns_once(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0, min_scale=1.0, alert_after=100, alerts=True)
  _run(tx, [I, I, I, I])  # 2 -> 1 (not stuck yet), then skips at the minimum
  recs = _warnings(caplog)
  assert len(recs) == 1 and "stuck at its minimum 1" in recs[0].getMessage() and "step 1" in recs[0].getMessage()


def test_alerts_only_from_process_zero(caplog, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), alerts=True)
  _run(tx, [I, I, I])
  assert _warnings(caplog) == []


def test_one_warning_under_jit_with_8_device_named_sharding(caplog):
  mesh = jax.make_mesh((8,), ("data",))
  put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if x.ndim else P())), t)
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), alerts=True)
  state = _run(tx, [I, I, I, I], put=put)
  assert len(_warnings(caplog)) == 1
  assert int(state.consecutive_skips) == 4


def test_one_warning_under_shard_map(caplog):
  mesh = jax.make_mesh((8,), ("data",))
  put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if x.ndim else P())), t)
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), axis_name="data", alerts=True)
  state_spec = jax.tree.map(lambda _: P(), tx.init(PARAMS))
  update = jax.jit(jax.shard_map(tx.update, mesh=mesh, in_specs=(P("data"), state_spec, P("data")),
                                 out_specs=(P("data"), state_spec)))
  _run(tx, [I, I, I], update=update, put=put)
  assert len(_warnings(caplog)) == 1


def test_one_warning_under_pmap(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), axis_name="d", alerts=True)
  n = jax.local_device_count()
  rep = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), t)
  update = jax.pmap(tx.update, axis_name="d")
  state = rep(tx.init(PARAMS))
  for k in (I, I, I):
    _, state = update(rep(_grads(k)), state, rep(PARAMS))
  assert len(_warnings(caplog)) == 1


def test_vmap_runs_with_alerts_on(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), alerts=True)
  states = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(2))
  grads = jax.tree.map(lambda x: jnp.stack([x, x]), _grads(I))
  _, states = jax.jit(jax.vmap(tx.update, in_axes=(0, 0, None)))(grads, states, PARAMS)
  assert np.all(np.asarray(states.consecutive_skips) == 1)


def _hlo(tx):
  state = tx.init(PARAMS)
  return jax.jit(tx.update).lower(_grads(F), state, PARAMS).as_text()


@pytest.mark.parametrize("make", [
    functools.partial(optax_dls.dynamic_loss_scale, optax.adam(1e-3)),
    functools.partial(optax_dls.static_loss_scale, optax.adam(1e-3), 128.0),
], ids=["dynamic", "static"])
def test_alerts_off_compile_no_callback(make):
  on, off = _hlo(make(alerts=True)), _hlo(make(alerts=False))
  assert _hlo(make()) == off  # off by default
  assert "custom_call" in on and "callback" in on  # the check below can fail
  assert "custom_call" not in off and "callback" not in off


def test_bad_alert_after():
  with pytest.raises(ValueError, match="alert_after"):
    optax_dls.dynamic_loss_scale(optax.sgd(0.1), alert_after=0)
  with pytest.raises(TypeError, match="alerts"):
    optax_dls.dynamic_loss_scale(optax.sgd(0.1), alerts="yes")
