"""The public surface driven in random order: the seams hold after every step.

A hypothesis state machine trains a small model through ``tx.update``, ``apply_step`` and
``value_and_grad``, with an inf or a NaN injected in random leaves or a non-finite loss,
moves the state through a checkpoint into another kind of transformation (dynamic,
static, no-op, a lowered or raised ``max_scale``), resets the scale, and reads
``metrics`` and ``nonfinite_leaves``. After every step: the parameters are finite; a step
skips exactly when its gradients or its loss were not finite; the scale lies within the
current transformation's range; the names are those of the injected leaves;
``no_loss_scale`` equals the bare optimizer bit for bit.

``OPTAX_DLS_STATEFUL_EXAMPLES`` sets the number of runs (default 12, of up to 12 steps).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _compat import apply_step
from flax import serialization
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import optax_dls
from optax_dls._access.names import leaf_names

PARAMS = {"a": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array([0.25, 4.0], jnp.float32)}
NAMES = leaf_names(PARAMS)  # ['a', 'b']
SGD = optax.sgd(0.125)  # a power of two: the bare and the loss-scaled steps round alike


def _kinds():
  dynamic = functools.partial(optax_dls.dynamic_loss_scale, SGD, growth_interval=2, min_scale=1.0)
  return {
    "dynamic": (dynamic(init_scale=2.0**4, max_scale=2.0**6), (1.0, 2.0**6)),
    "dynamic-lower": (dynamic(init_scale=2.0, max_scale=2.0**2), (1.0, 2.0**2)),
    "dynamic-higher": (dynamic(init_scale=2.0**4, max_scale=2.0**10), (1.0, 2.0**10)),
    "static": (optax_dls.static_loss_scale(SGD, 2.0**3), (2.0**3, 2.0**3)),
    "none": (optax_dls.no_loss_scale(SGD), (1.0, 1.0)),
  }


KINDS = _kinds()


def _loss(params, x, bad):
  """A loss whose gradients are finite; ``log(bad)`` is -inf for ``bad`` = 0 (a data term of
  the batch alone), NaN for ``bad`` < 0."""
  return jnp.sum(params["a"] * x[:3]) + jnp.sum(jnp.square(params["b"]) * x[3:]) + jnp.log(bad)


@functools.cache
def _compiled(kind):
  tx, _ = KINDS[kind]
  grad_fn = optax_dls.value_and_grad(_loss, tx, max_tries=0)
  return {
    "update": jax.jit(tx.update),
    "apply_step": jax.jit(functools.partial(apply_step, tx)),
    "value_and_grad": jax.jit(grad_fn),
  }


def _scaled_grads(params, state, x, inject):
  """The gradients of ``S * loss`` with ``inject`` ({leaf: "inf" | "nan"}) written in."""
  scale = optax_dls.find_state(state).loss_scale
  grads = jax.grad(lambda p: _loss(p, x, 1.0) * scale)(params)
  poison = {"inf": jnp.inf, "nan": jnp.nan}
  return {k: g.at[0].set(poison[inject[k]]) if k in inject else g for k, g in grads.items()}


class Seams(RuleBasedStateMachine):
  @initialize(kind=st.sampled_from(sorted(KINDS)))
  def start(self, kind):
    self.kind = kind
    tx, _ = KINDS[kind]
    self.params, self.state = PARAMS, tx.init(PARAMS)
    self.bare = None if kind != "none" else (PARAMS, SGD.init(PARAMS))
    self.expected_names = {}
    self.last_skipped = False

  def _bare_step(self, grads):
    params, state = self.bare
    updates, state = SGD.update(grads, state, params)
    self.bare = (optax.apply_updates(params, updates), state)

  @rule(
    path=st.sampled_from(["update", "apply_step", "value_and_grad"]),
    inject=st.dictionaries(st.sampled_from(NAMES), st.sampled_from(["inf", "nan"]), max_size=2),
    loss_bad=st.sampled_from([1.0, 1.0, 0.0, -1.0]),
    x=st.lists(st.sampled_from([0.5, 1.0, 2.0, 8.0]), min_size=5, max_size=5),
  )
  def step(self, path, inject, loss_bad, x):
    if self.kind == "none":  # no loss scaling checks nothing: only finite steps are given
      inject, loss_bad = {}, 1.0
    x = jnp.asarray(x, jnp.float32)
    fns = _compiled(self.kind)
    self.unsettled = False
    before = self.params
    if path == "value_and_grad":
      inject = {}  # the gradients of the loss itself: only the loss can be made non-finite
      (_, grads), state = fns["value_and_grad"](self.state, self.params, x, jnp.float32(loss_bad))
      updates, self.state = fns["update"](grads, state, self.params)
      self.params = optax.apply_updates(self.params, updates)
    else:
      grads = _scaled_grads(self.params, self.state, x, inject)
      loss = _loss(self.params, x, jnp.float32(loss_bad))
      if path == "update":
        updates, self.state = fns["update"](grads, self.state, self.params, loss=loss)
        self.params = optax.apply_updates(self.params, updates)
      else:
        self.params, self.state = fns["apply_step"](grads, self.state, self.params, loss=loss)
    bad = bool(inject) or loss_bad != 1.0
    m = optax_dls.metrics(self.state)
    assert bool(m["skipped"]) == bad, (path, inject, loss_bad)
    if bad:
      self.expected_names = inject  # the record of the last non-finite step
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(self.params)):
        np.testing.assert_array_equal(a, b)  # a skipped step leaves the parameters
    if self.bare is not None:
      self._bare_step(jax.grad(_loss)(before, x, 1.0))

  @rule(kind=st.sampled_from(sorted(KINDS)))
  def checkpoint_into(self, kind):
    """Saved with flax's serialization, restored into ``kind``'s layout; its next update
    settles the scale for it."""
    tx, _ = KINDS[kind]
    saved = serialization.to_state_dict({"params": self.params, "opt_state": self.state})
    target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    restored = serialization.from_state_dict(target, saved)
    self.params, self.state, self.kind = restored["params"], restored["opt_state"], kind
    self.unsettled = True  # the saved scale, until the next update
    self.bare = (self.params, SGD.init(self.params)) if kind == "none" else None

  @rule(exponent=st.integers(0, 10))
  def reset(self, exponent):
    _, (low, high) = KINDS[self.kind]
    value = float(np.clip(2.0**exponent, low, high))
    self.state = optax_dls.reset_scale(self.state, value)
    assert float(optax_dls.find_state(self.state).loss_scale) == value

  @invariant()
  def parameters_are_finite(self):
    if hasattr(self, "params"):
      assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(self.params))

  @invariant()
  def the_scale_is_in_the_current_range(self):
    if hasattr(self, "state") and not getattr(self, "unsettled", False):
      _, (low, high) = KINDS[self.kind]
      assert low <= float(optax_dls.find_state(self.state).loss_scale) <= high

  @invariant()
  def the_names_are_those_injected(self):
    if hasattr(self, "state"):
      assert optax_dls.nonfinite_leaves(self.state, PARAMS) == self.expected_names

  @invariant()
  def no_loss_scale_is_the_bare_optimizer(self):
    if getattr(self, "bare", None) is not None:
      for a, b in zip(jax.tree.leaves(self.bare[0]), jax.tree.leaves(self.params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


Seams.TestCase.settings = settings(
  max_examples=int(os.environ.get("OPTAX_DLS_STATEFUL_EXAMPLES", "12")),
  stateful_step_count=12,
  deadline=None,
)
TestSeams = Seams.TestCase
