"""Each new state value selected where the inner update computes it, construct by construct.

For each construct, on a finite step the outputs and the new state are what the update
returns, bit for bit; on a skipped step the new state is the old one (bits, dtype, weak
type) and every value downstream of a selected state value reads the old value.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend import core as jax_core
from jax.interpreters import mlir

import optax_dls
from optax_dls._core import jaxpr_select as _jaxpr_select

G = jnp.array([0.5, -1.5], jnp.float32)
M = jnp.array([2.0, 3.0], jnp.float32)
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
FINITE = pytest.mark.parametrize("finite", [True, False], ids=["finite", "skipped"])


def _leaf(x):
  if isinstance(x, (int, float)):
    x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    return (str(x.dtype), x.shape, np.asarray(jax.random.key_data(x)).tobytes())
  return (str(x.dtype), x.shape, bool(jax.typeof(x).weak_type), np.asarray(x).tobytes())


def _desc(tree):
  """The tree's structure and each leaf's dtype, shape, weak type and bits."""
  return str(jax.tree.structure(tree)), [_leaf(x) for x in jax.tree.leaves(tree)]


def _call(fn, jit, *args):
  return (jax.jit(fn) if jit else fn)(*args)


def _selected(apply, jit, finite, grads, state, params=None):
  def run(f, g, s, p):
    return _jaxpr_select.selected_at_definition(f, apply, g, s, p)

  return _call(run, jit, jnp.bool_(finite), grads, state, params)


def _at_end(finite, apply, grads, state, params):
  """Everything selected at the end: the reference for the fallback."""
  out, new = apply(grads, state, params)
  return out, jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)


@pytest.fixture
def no_fallback(monkeypatch):
  """Fails the test if the evaluation equation by equation raises (and falls back)."""
  raised = []
  evaluate = _jaxpr_select._evaluate

  def spy(*args):
    try:
      return evaluate(*args)
    except Exception as e:
      raised.append(e)
      raise

  monkeypatch.setattr(_jaxpr_select, "_evaluate", spy)
  yield
  assert not raised


@dataclasses.dataclass(frozen=True)
class Case:
  """An update ``(readout(g, new, p), new)`` with ``new = step(g, state, p)``; ``readout``
  reads only state values selected where they are computed."""

  state: Any
  step: Callable[..., Any]
  readout: Callable[..., Any] = lambda g, s, p: g * 3.0

  def apply(self, g, s, p):
    new = self.step(g, s, p)
    return self.readout(g, new, p), new


@jax.custom_jvp
def _jvp_step(m, g):
  return m * 0.5 + g


@_jvp_step.defjvp
def _jvp_step_jvp(primals, tangents):
  return _jvp_step(*primals), tangents[0] * 0.5 + tangents[1]


@jax.custom_vjp
def _vjp_step(m, g):
  return m * 0.5 + g


_vjp_step.defvjp(lambda m, g: (_vjp_step(m, g), None), lambda _, t: (t * 0.5, t))

CONSTANT = jnp.array([1.0, 4.0], jnp.float32)


def _m2(g, s, p):
  return s["m"] * 2.0


def _twice(g, s, p):
  new = s["a"] + g
  return {"a": new, "b": new}


def _m(step):
  """A state ``{"m": M}`` updated by ``step(m, g)``, read out as ``2 m``."""
  return Case({"m": M}, lambda g, s, p: {"m": step(s["m"], g)}, _m2)


CASES = {
  "arithmetic": Case(
    {"m": M, "v": jnp.array([1.0, 0.25], jnp.float16)},
    lambda g, s, p: {"m": s["m"] * 0.5 + g, "v": s["v"] + (g * g).astype(jnp.float16)},
    lambda g, s, p: s["m"] * 2.0 + s["v"].astype(jnp.float32),
  ),
  "zeros_constant": Case(
    {"m": M, "z": jnp.float32(3.0)}, lambda g, s, p: {"m": s["m"] + g, "z": jnp.zeros([])}, _m2
  ),
  "python_float": Case({"m": M, "c": 1.0}, lambda g, s, p: {"m": s["m"] + g, "c": 2.0}, _m2),
  "weak_scalar_literal": Case(
    {"m": M, "w": jnp.asarray(5.0)}, lambda g, s, p: {"m": s["m"] + g, "w": jnp.asarray(3.0)}, _m2
  ),
  "float32_scalar_literal": Case(
    {"m": M, "f": jnp.float32(5.0)}, lambda g, s, p: {"m": s["m"] + g, "f": jnp.float32(1.5)}, _m2
  ),
  "weak_scalar": Case(
    {"w": jnp.asarray(1.0)}, lambda g, s, p: {"w": s["w"] * 0.5 + 1.0}, lambda g, s, p: s["w"] * g
  ),
  "closed_over_array": Case(
    {"m": M, "c": jnp.array([7.0, 8.0])}, lambda g, s, p: {"m": s["m"] + g, "c": CONSTANT}, _m2
  ),
  "int_counter": Case(
    {"count": jnp.zeros([], jnp.int32), "m": M},
    lambda g, s, p: {"count": optax.safe_increment(s["count"]), "m": s["m"]},
    lambda g, s, p: g * s["count"].astype(jnp.float32),
  ),
  "typed_key": Case(
    {"key": jax.random.key(0)},
    lambda g, s, p: {"key": jax.random.split(s["key"])[0]},
    lambda g, s, p: jax.random.uniform(s["key"], (2,)),
  ),
  "raw_uint32_key": Case(
    {"key": jax.random.key_data(jax.random.key(0))},
    lambda g, s, p: {"key": jax.random.split(s["key"])[0]},
    lambda g, s, p: jax.random.uniform(s["key"], (2,)),
  ),
  "none_leaf": Case({"m": M, "n": None}, lambda g, s, p: {"m": s["m"] + g, "n": None}, _m2),
  "passed_through": Case(
    {"m": M, "c": jnp.array([7.0, 8.0])},
    lambda g, s, p: {"m": s["m"] + g, "c": s["c"]},
    lambda g, s, p: s["m"] + s["c"],
  ),
  "returned_twice": Case({"a": M, "b": jnp.array([7.0, 8.0])}, _twice),
  "nested_jit": _m(jax.jit(lambda m, g: m * 0.5 + g)),
  "custom_jvp": _m(_jvp_step),
  "custom_vjp": _m(_vjp_step),
  "cond": _m(lambda m, g: lax.cond(jnp.sum(g) < 0, lambda: m * 0.5 + g, lambda: m - g)),
  "while_loop": _m(
    lambda m, g: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5 + g), (0, m))[1]
  ),
  "scan": _m(lambda m, g: lax.scan(lambda c, x: (c * 0.5 + x, c.sum()), m, jnp.stack([g, g]))[0]),
  "fori_loop": _m(lambda m, g: lax.fori_loop(0, 3, lambda i, c: c * 0.5 + g, m)),
  "checkpoint": _m(jax.checkpoint(lambda m, g: m * m + g)),
}


def test_the_state_values_differ_from_one_step_to_the_next():
  """A skipped step is only seen if the update changes the state."""
  for name, case in CASES.items():
    if name != "none_leaf":
      new = case.step(G, case.state, None)
      assert _desc(new) != _desc(case.state), name


@JIT
@FINITE
@pytest.mark.parametrize("name", sorted(CASES))
def test_construct(name, finite, jit, no_fallback):
  """Finite: what the update returns. Skipped: the old state, and the readout of it."""
  case = CASES[name]
  out, new = _selected(case.apply, jit, finite, G, case.state)
  if finite:
    want_out, want_new = _call(case.apply, jit, G, case.state, None)
  else:
    want_out, want_new = _call(case.readout, jit, G, case.state, None), case.state
  assert _desc(new) == _desc(want_new)
  assert _desc(out) == _desc(want_out)


@JIT
def test_values_downstream_of_a_selected_value_read_it(jit, no_fallback):
  def apply(g, s, p):
    new = s + g
    return {"twice": new * 2.0, "sum": jnp.sum(new * new)}, new

  out, new = _selected(apply, jit, False, G, M)
  np.testing.assert_array_equal(new, M)
  np.testing.assert_array_equal(out["twice"], M * 2.0)
  np.testing.assert_array_equal(out["sum"], jnp.sum(M * M))
  out, new = _selected(apply, jit, True, G, M)
  np.testing.assert_array_equal(out["twice"], (M + G) * 2.0)


@JIT
@FINITE
def test_debug_callbacks_run_once_in_order(finite, jit, no_fallback):
  seen = []

  def apply(g, s, p):
    jax.debug.callback(lambda x: seen.append(("before", x.tolist())), s, ordered=True)
    new = s + g
    jax.debug.callback(lambda x: seen.append(("after", x.tolist())), new, ordered=True)
    return new * 2.0, new

  _selected(apply, jit, finite, G, M)
  jax.effects_barrier()
  after = (M + G) if finite else M
  assert seen == [("before", M.tolist()), ("after", after.tolist())]


@JIT
@FINITE
def test_debug_print_runs_once_in_order(finite, jit, capfd, no_fallback):
  def apply(g, s, p):
    jax.debug.print("first {}", s[0], ordered=True)
    new = s + g
    jax.debug.print("second {}", new[0], ordered=True)
    return new * 2.0, new

  _selected(apply, jit, finite, G, M)
  jax.effects_barrier()
  second = float((M + G)[0] if finite else M[0])
  assert capfd.readouterr().out.split("\n") == [f"first {float(M[0])}", f"second {second}", ""]


class _Unbindable(jax_core.Primitive):
  """A primitive that runs, but that an interpreter of its jaxpr cannot bind."""

  def get_bind_params(self, params):
    raise NotImplementedError("no bind params")


_unbindable = _Unbindable("unbindable_negate")
_unbindable.def_impl(lambda x: -x)
_unbindable.def_abstract_eval(lambda x: x)
mlir.register_lowering(_unbindable, mlir.lower_fun(lambda x: -x, multiple_results=False))


def _downstream(g, s, p):
  new = {"m": s["m"] * 0.5 + g, "k": _unbindable.bind(s["k"])}
  return new["m"] * 2.0, new


@JIT
@FINITE
@pytest.mark.parametrize("how", ["evaluate_raises", "unbindable_primitive"])
def test_a_failed_bind_selects_everything_at_the_end(how, finite, jit, monkeypatch):
  if how == "evaluate_raises":

    def fail(*args, **kwargs):
      raise RuntimeError("cannot bind")

    monkeypatch.setattr(_jaxpr_select, "_evaluate", fail)
  state = {"m": M, "k": jnp.array([1.0, -2.0])}
  got = _selected(_downstream, jit, finite, G, state)
  want = _call(lambda f, g, s: _at_end(f, _downstream, g, s, None), jit, finite, G, state)
  assert _desc(got) == _desc(want)
  if not finite:  # at the end: the outputs read the unselected new state
    assert _desc(got[1]) == _desc(state)
    np.testing.assert_array_equal(got[0], (M * 0.5 + G) * 2.0)


@JIT
@FINITE
def test_a_failed_bind_repeats_no_effect(finite, jit):
  """An effect bound before the equation that fails is not run a second time."""
  seen = []

  def apply(g, s, p):
    jax.debug.callback(lambda x: seen.append(x.tolist()), s["m"], ordered=True)
    return _downstream(g, s, p)

  _selected(apply, jit, finite, G, {"m": M, "k": jnp.array([1.0, -2.0])})
  jax.effects_barrier()
  assert seen == [M.tolist()]


def _inner() -> optax.GradientTransformation:
  """An optimizer whose update holds a ``lax.cond``, a ``lax.scan`` and a ``custom_vjp``."""

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"count": jnp.zeros([], jnp.int32), "m": zeros, "h": zeros}

  def update(grads, state, params):
    first = state["count"] == 0
    m = jax.tree.map(
      lambda m, g: lax.cond(first, lambda: g, lambda: m * 0.9 + g * 0.1), state["m"], grads
    )
    h = jax.tree.map(
      lambda h, g: lax.scan(lambda c, x: (c * 0.5 + x * x, None), h, jnp.stack([g, g]))[0],
      state["h"],
      grads,
    )
    updates = jax.tree.map(lambda m, h: -0.1 * _vjp_step(m, jnp.sqrt(h)), m, h)
    return updates, {"count": optax.safe_increment(state["count"]), "m": m, "h": h}

  return optax.GradientTransformation(init, update)


def test_where_skip_through_the_public_api(no_fallback):
  params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array([[1.0, 3.0]])}
  grads = [jax.tree.map(lambda p, i=i: p * (i + 1.0) - 0.25, params) for i in range(3)]
  bad = dict(grads[0], b=grads[0]["b"].at[0, 1].set(jnp.inf))
  inner = _inner()
  tx = optax_dls.dynamic_loss_scale(
    inner, init_scale=16.0, growth_interval=1000, skip_lowering="where"
  )

  @jax.jit
  def update(g, s, p):  # the scale stays a power of two: unscaling is exact
    return tx.update(jax.tree.map(lambda x: x * optax_dls.find_state(s).loss_scale, g), s, p)

  bare = jax.jit(inner.update)
  state, bare_state = tx.init(params), inner.init(params)
  for g in (grads[0], bad, grads[1], bad, grads[2]):
    before = state.inner_state
    updates, state = update(g, state, params)
    if g is bad:
      assert _desc(state.inner_state) == _desc(before)
      assert all(not bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    else:
      bare_updates, bare_state = bare(g, bare_state, params)
      assert _desc(updates) == _desc(bare_updates)
      assert _desc(state.inner_state) == _desc(bare_state)
  assert int(state.num_skipped) == 2 and int(state.inner_state["count"]) == 3
