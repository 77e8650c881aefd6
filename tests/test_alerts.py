"""SkipAlerts: one logging warning per episode of consecutive skips, and one when stuck at
min_scale."""

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
  return [r for r in caplog.records if r.name == "optax_dls" and r.levelno == logging.WARNING]


def _run(tx, kinds, alerts, update=None, put=lambda x: x, every=1):
  update = update or jax.jit(tx.update)
  state = put(tx.init(PARAMS))
  for step, k in enumerate(kinds):
    _, state = update(put(_grads(k)), state, put(PARAMS))
    if step % every == 0:
      alerts(step, optax_dls.metrics(state))
  return state


def test_one_warning_per_episode_with_step_scale_and_count(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10)
  _run(tx, [F, I, I, I, I, I, F, I, I, I], optax_dls.SkipAlerts(alert_after=3))
  recs = _warnings(caplog)
  assert len(recs) == 2, [r.getMessage() for r in recs]
  first, second = (r.getMessage() for r in recs)
  assert (
    "3 consecutive skipped steps" in first and "step 3" in first and "loss scale now 128" in first
  )
  assert "step 9" in second and f"loss scale now {2**10 // 2**8}" in second  # 8 backoffs so far


def test_no_warning_below_threshold(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  alerts = optax_dls.SkipAlerts(alert_after=4)
  _run(tx, [I, I, I, F, I, I, I, F], alerts)
  assert _warnings(caplog) == [] and alerts.fired == []


def test_sparse_calls_still_see_a_long_episode_once(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  alerts = optax_dls.SkipAlerts(alert_after=3)
  _run(tx, [F] + [I] * 9 + [F], alerts, every=5)  # looked at steps 0, 5 and 10 only
  assert len(_warnings(caplog)) == 1 and "5 consecutive skipped steps at step 5" in alerts.fired[
    0
  ].replace(" (non-finite gradients)", "")


def test_stuck_at_min_scale_warns_once(caplog):
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy(init_scale=2.0, min_scale=1.0))
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  _run(tx, [I, I, I, I], optax_dls.SkipAlerts(alert_after=100))  # 2 -> 1, then skips at the minimum
  recs = _warnings(caplog)
  assert (
    len(recs) == 1
    and "stuck at its minimum 1" in recs[0].getMessage()
    and "step 1" in recs[0].getMessage()
  )


def test_alerts_only_from_process_zero(caplog, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  alerts = optax_dls.SkipAlerts()
  _run(optax_dls.dynamic_loss_scale(optax.sgd(0.1)), [I, I, I], alerts)
  assert _warnings(caplog) == [] and len(alerts.fired) == 1  # decided, not logged, off process 0


def test_one_warning_under_jit_with_8_device_named_sharding(caplog):
  mesh = jax.make_mesh((8,), ("data",))
  put = lambda t: jax.tree.map(
    lambda x: jax.device_put(
      x, NamedSharding(mesh, P("data") if x.ndim and x.shape[0] % 8 == 0 else P())
    ),
    t,
  )
  state = _run(
    optax_dls.dynamic_loss_scale(optax.sgd(0.1)), [I, I, I, I], optax_dls.SkipAlerts(), put=put
  )
  assert len(_warnings(caplog)) == 1
  assert int(state.consecutive_skips) == 4


def test_one_warning_under_pmap(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), axis_name="d")
  n = jax.local_device_count()
  rep = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), t)
  update = jax.pmap(tx.update, axis_name="d")
  state = rep(tx.init(PARAMS))
  alerts = optax_dls.SkipAlerts()
  for step, k in enumerate((I, I, I)):
    _, state = update(rep(_grads(k)), state, rep(PARAMS))
    alerts(step, jax.tree.map(lambda x: x[0], optax_dls.metrics(state)))  # device 0's copy
  assert len(_warnings(caplog)) == 1


def test_one_warning_under_shard_map(caplog):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  put = lambda t: jax.tree.map(
    lambda x: jax.device_put(
      x, NamedSharding(mesh, P("data") if x.ndim and x.shape[0] % 8 == 0 else P())
    ),
    t,
  )
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  state_spec = jax.tree.map(lambda _: P(), tx.init(PARAMS))
  update = jax.jit(
    jax.shard_map(
      tx.update,
      mesh=mesh,
      in_specs=(P("data"), state_spec, P("data")),
      out_specs=(P("data"), state_spec),
    )
  )
  _run(tx, [I, I, I], optax_dls.SkipAlerts(), update=update, put=put)
  assert len(_warnings(caplog)) == 1


def test_each_member_of_a_vmapped_ensemble_gets_its_own_alerts(caplog):
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  states = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(2))
  update = jax.jit(jax.vmap(tx.update, in_axes=(0, 0, None)))
  alerts = [optax_dls.SkipAlerts(alert_after=2) for _ in range(2)]
  for step in range(3):  # member 0 overflows every step, member 1 never
    grads = jax.tree.map(lambda i, f: jnp.stack([i, f]), _grads(I), _grads(F))
    _, states = update(grads, states, PARAMS)
    m = optax_dls.metrics(states)
    for member, a in enumerate(alerts):
      a(step, jax.tree.map(lambda x, member=member: x[member], m))
  assert len(alerts[0].fired) == 1 and alerts[1].fired == [] and len(_warnings(caplog)) == 1


def test_the_jitted_step_holds_no_callback():
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  state = tx.init(PARAMS)
  text = jax.jit(tx.update).lower(_grads(F), state, PARAMS).as_text()
  assert "callback" not in text and "custom_call" not in text
  # The same check finds a host callback in a step that holds one, so it can fail.
  noisy = jax.jit(lambda g, s, p: jax.debug.callback(print, tx.update(g, s, p)[1].num_steps))
  assert "callback" in noisy.lower(_grads(F), state, PARAMS).as_text()


@pytest.mark.parametrize(
  "bad, error",
  [(0, ValueError), (-1, ValueError), (2.5, TypeError), ("3", TypeError), (True, TypeError)],
)
def test_bad_alert_after(bad, error):
  with pytest.raises(error, match="alert_after"):
    optax_dls.SkipAlerts(alert_after=bad)


def test_bad_call_arguments():
  alerts = optax_dls.SkipAlerts()
  m = optax_dls.metrics(optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS))
  with pytest.raises(TypeError, match="step"):
    alerts(jnp.int32(3), m)
  with pytest.raises(TypeError, match="metrics"):
    alerts(3, [1, 2])
  assert alerts(np.int64(3), m) == []  # NumPy integers are fine
