"""The user-written policy of docs/policies.md runs as printed, through optax_dls.loss_scaled."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def _load_policy():
  text = DOC.read_text()
  match = re.search(r"<!-- test: user-policy -->\s*```python\n(.*?)```", text, re.S)
  assert match, "docs/policies.md lost its user-policy code block"
  code = match.group(1)
  assert 10 <= len(code.strip().splitlines()) <= 30
  namespace = {}
  exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
  return namespace["norm_target_policy"]


def test_documented_policy_runs_inside_loss_scaled():
  policy = _load_policy()(init_scale=2.0**10, target=2.0**12)
  assert isinstance(policy, optax_dls.LossScalePolicy)
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  params = {"w": jnp.zeros([4], jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  true_grad = jnp.asarray([0.5, -0.5, 0.5, -0.5])  # global norm 1
  scales, updates_seen = [], []
  for value in (1.0, 1.0, 1.0, jnp.inf, 1.0):
    grads = {"w": true_grad * value * optax_dls.loss_scale(state)}
    updates, state = update(grads, state, params)
    scales.append(float(optax_dls.loss_scale(state)))
    updates_seen.append(np.asarray(updates["w"]))
  # Towards S * norm = 2**12 from 2**10, one octave a step; then held; halved on inf.
  assert scales == [2.0**11, 2.0**12, 2.0**12, 2.0**11, 2.0**12]
  np.testing.assert_array_equal(updates_seen[0], -0.1 * np.asarray(true_grad))  # unscaled exactly
  assert not np.any(updates_seen[3])  # the non-finite step was skipped
  assert int(optax_dls.find_state(state).policy_state) == 1  # one backoff counted
  assert int(optax_dls.metrics(state)["skip_count"]) == 1
