"""The zoo: the update contract (docs/design.md) around every optimizer optax ships.

Each inner below is wrapped by ``dynamic_loss_scale`` on two parameter trees (all
float32, and mixed float16/float32) under each skip lowering, and run through one
sequence of scaled gradients: a NaN step (skipped, straight from ``init``), a finite
step, an inf step (skipped) and a finite step, on both call paths (``tx.update`` with
``optax.apply_updates``, and ``apply_step``). Three checks:

1. a finite step equals the bare inner optimizer on the unscaled gradients, to
   float32 (float16) rounding: the updates, the parameters and the inner state;
2. a skipped step leaves the parameters (a ``-0.0`` entry among them) and the inner
   state bit for bit, on both paths, with zero updates;
3. the state's types (tree structure, shape, dtype, weak type) are a fixed point
   from ``init``: a ``lax.scan`` over the sequence with the state as carry traces, and
   the step, jitted and called once per step from its own output carry, compiles once.

The loss scale is a power of two throughout (2**4, backed off to 2**3 and 2**2 by
the skips), so unscaling is exact and the bare optimizer sees the same bits.

Which inners: the optimizers are discovered from optax's namespaces, so that a new
optax release's additions are covered without editing this file:

* ``optax``: every public function that takes a learning rate (a parameter named
  ``learning_rate`` or ending in ``_learning_rate``), except the ``scale_by_*``
  building blocks (their optimizers are here);
* ``optax.contrib``: the same, and every other public function annotated to return
  a transformation (the wrappers ``mechanize``, ``sam``, ``schedule_free``, ...,
  and ``reduce_on_plateau``), except the ``scale_by_*`` blocks.

"Constructs with default arguments" means: called with ``learning_rate`` (when it
takes one) and nothing else, and its update needing no extra argument. The few
that need more are in ``SPECIAL`` (how to build them, which extra arguments their
update gets: a loss value, its gradient, the loss function); ``NOT_AN_INNER`` names
the ones that cannot take this gradient tree at all, with the reason. A newly
discovered name that neither constructs with defaults nor is in a table fails
``test_every_discovered_optimizer_is_covered``, so nothing is skipped silently.

Beside them: ``inject_hyperparams``, the combinators (``chain``, ``masked``,
``multi_transform``, ``MultiSteps``, ``apply_every``) and hand-written inners whose
state holds one special construct each (named in the test id).

Where a bare optimizer cannot do better, the wrapper is not asked to: a bare
optimizer that cannot step on a tree skips that tree (with its error), and the
fixed point of check 3 is demanded whenever the bare optimizer's own state types
reach one within a few updates (widening float16 to float32 on the first or second
update, say); the wrapped state must then be at it from ``init``.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from _compat import apply_step
from jax import lax

import optax_dls

pytestmark = pytest.mark.filterwarnings("ignore:`optimistic_adam` is deprecated")

LR = 1e-2
SCALE = 2.0**4
LOWERINGS = ("auto", "cond", "where")
TREES = ("f32", "mixed")
STEPS_FINITE = (False, True, False, True)  # NaN, finite, inf, finite
BARE_UPDATES = 3  # updates within which the bare optimizer's state types must settle


# -- trees and gradients ---------------------------------------------------------------------------


def _params(tree):
  low = jnp.float16 if tree == "mixed" else jnp.float32
  return {
    "w": jnp.array([[-0.0, 0.5], [1.0, -1.5], [0.25, 2.0]], jnp.float32),
    "b": jnp.array([0.75, -0.25], jnp.float32),
    "v": jnp.array([1.0, -0.0, -0.5], low),
  }


def _unscaled_grads(tree):
  """The unscaled gradients of the four steps, stacked; exact in float16 at any scale used."""
  base = _params(tree)
  grads = {
    "w": np.array([[0.5, -0.25], [0.125, 1.0], [-0.75, 0.375]]),
    "b": np.array([-0.5, 0.25]),
    "v": np.array([0.25, -0.5, 0.125]),
  }
  steps = []
  for k in range(len(STEPS_FINITE)):
    g = {n: (x * (k + 1) * (-1) ** k).astype(base[n].dtype) for n, x in grads.items()}
    steps.append(g)
  steps[0]["w"][1, 0] = np.nan
  steps[2]["v"][2] = np.inf
  return jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *steps)


def _step(us, k):
  return jax.tree.map(lambda x: x[k], us)


def _scaled(u, state):
  scale = optax_dls.find_state(state).loss_scale
  return jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(x.dtype), u)


def _loss(params):
  """The loss whose value (and function) the inners that ask for one get."""
  leaves = jax.tree.leaves(params)
  return sum(0.5 * jnp.sum(jnp.square(p.astype(jnp.float32) - 0.25)) for p in leaves)


# -- the inners ------------------------------------------------------------------------------------

NO_EXTRAS = lambda params, u: {}
VALUE = lambda params, u: {"value": _loss(params)}
OBJ_FN = lambda params, u: {"obj_fn": _loss}
# L-BFGS's zoom linesearch: the loss value at params, its gradient (the unscaled one,
# which optax.value_and_grad_from_state would otherwise read from the state) and the loss.
LINESEARCH = lambda params, u: {"value": _loss(params), "grad": u, "value_fn": _loss}

# name -> (factory, extra arguments of update from (params, unscaled grads)), for the
# discovered names that need more than a learning rate, and a few variants.
SPECIAL = {
  "lbfgs": (lambda: optax.lbfgs(), LINESEARCH),
  "polyak_sgd": (lambda: optax.polyak_sgd(LR), VALUE),
  "noisy_sgd": (lambda: optax.noisy_sgd(LR, key=jax.random.key(0)), NO_EXTRAS),
  "sgd-momentum": (lambda: optax.sgd(LR, momentum=0.9), NO_EXTRAS),
  "sgd-nesterov": (lambda: optax.sgd(LR, momentum=0.9, nesterov=True), NO_EXTRAS),
  "contrib.momo": (lambda: optax.contrib.momo(LR), VALUE),
  "contrib.momo_adam": (lambda: optax.contrib.momo_adam(LR), VALUE),
  "contrib.reduce_on_plateau": (lambda: optax.contrib.reduce_on_plateau(), VALUE),
  "contrib.sophia": (lambda: optax.contrib.sophia(LR), OBJ_FN),
  "contrib.mechanize": (lambda: optax.contrib.mechanize(optax.sgd(LR)), NO_EXTRAS),
  "contrib.sam": (lambda: optax.contrib.sam(optax.sgd(LR), optax.sgd(LR)), NO_EXTRAS),
  "contrib.schedule_free": (
    lambda: optax.contrib.schedule_free(optax.sgd(LR), LR),
    NO_EXTRAS,
  ),
  "contrib.split_real_and_imaginary": (
    lambda: optax.contrib.split_real_and_imaginary(optax.adam(LR)),
    NO_EXTRAS,
  ),
}
# Discovered names that cannot be an inner for a gradient tree shaped like the parameters.
NOT_AN_INNER = {
  "contrib.dpsgd": "needs per-example gradients (a leading batch axis on every leaf)",
  "contrib.differentially_private_aggregate": "needs per-example gradients",
}


def _takes_learning_rate(fn):
  try:
    names = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return any(n == "learning_rate" or n.endswith("_learning_rate") for n in names)


def _returns_transformation(fn):
  try:
    ann = inspect.signature(fn).return_annotation
  except (TypeError, ValueError):
    return False
  return isinstance(ann, type) and issubclass(ann, optax.GradientTransformation)


def _discover(module, prefix, keep):
  names = []
  for name in sorted(dir(module)):
    fn = getattr(module, name)
    if name.startswith(("_", "scale_by_")) or isinstance(fn, type) or not callable(fn):
      continue
    if keep(fn):
      names.append(prefix + name)
  return names


DISCOVERED = _discover(optax, "", _takes_learning_rate) + _discover(
  optax.contrib, "contrib.", lambda fn: _takes_learning_rate(fn) or _returns_transformation(fn)
)


def _function(name):
  module = optax.contrib if name.startswith("contrib.") else optax
  return getattr(module, name.removeprefix("contrib."))


def _default(name):
  fn = _function(name)
  takes = "learning_rate" in inspect.signature(fn).parameters
  return (lambda: fn(learning_rate=LR)) if takes else fn


def _handwritten(construct):
  """An sgd-like inner whose state holds one special construct."""
  make = {
    "literal_constant": lambda: jnp.zeros(()),
    "python_scalar": lambda: 0.5,
    "weak_scalar": lambda: jnp.asarray(0.5),  # weakly typed, and kept so by the update
    "typed_key": lambda: jax.random.key(0),
    "uint32_key": lambda: jax.random.PRNGKey(0),
    "int_counter": lambda: jnp.zeros([], jnp.int32),
    "none": lambda: None,
  }[construct]

  def update(updates, state, params=None):
    del params
    x, factor, shift = state["x"], LR, 0.0
    if construct == "literal_constant":
      shift, x = x, jnp.zeros(())  # the new state: a constant, computed from no input
    elif construct == "python_scalar":
      factor, x = LR * x, 0.5
    elif construct == "weak_scalar":
      factor, x = LR * x, x * 0.5
    elif construct == "int_counter":
      factor, x = LR / (1.0 + x.astype(jnp.float32)), optax.safe_increment(x)
    elif construct in ("typed_key", "uint32_key"):
      x, sub = jax.random.split(x)
      shift = 1e-3 * jax.random.uniform(sub)
    return jax.tree.map(lambda g: (shift - factor * g).astype(g.dtype), updates), {"x": x}

  return optax.GradientTransformation(lambda params: {"x": make()}, update)


def _needs_value():
  """An inner whose update raises its own error (not a TypeError) without ``value=``, as
  ``optax.contrib.momo`` did in optax 0.2.5, and widens its float16 state to float32 from
  the loss: ``init`` has to trace it with a ``value`` to settle the state's dtype."""

  def update(updates, state, params=None, *, value=None):
    del params
    if value is None:
      raise ValueError("this inner needs the loss as value=")
    x = 0.5 * state["x"] + 0.5 * value  # float16 state, float32 loss: float32 from then on
    return jax.tree.map(lambda g: (-LR * g).astype(g.dtype), updates), {"x": x}

  init = lambda params: {"x": jnp.zeros([], jnp.float16)}
  return optax.GradientTransformationExtraArgs(init, update)


_ADAM_LABELS = {"w": "adam", "b": "sgd", "v": "adam"}
OTHERS = {
  "inject_hyperparams-adam-float_lr": lambda: optax.inject_hyperparams(optax.adam)(LR),
  "inject_hyperparams-adam-constant_schedule": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=optax.constant_schedule(LR)
  ),
  "inject_hyperparams-adam-exponential_decay": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=optax.exponential_decay(LR, transition_steps=1, decay_rate=0.5)
  ),
  "chain-clip-decay-adam": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-4), optax.adam(LR)
  ),
  "masked-adam": lambda: optax.masked(optax.adam(LR), {"w": True, "b": False, "v": True}),
  "multi_transform-adam-sgd": lambda: optax.multi_transform(
    {"adam": optax.adam(LR), "sgd": optax.sgd(LR)}, _ADAM_LABELS
  ),
  "MultiSteps-adam-k2": lambda: optax.MultiSteps(optax.adam(LR), every_k_schedule=2),
  "chain-adam-apply_every-k2": lambda: optax.chain(optax.adam(LR), optax.apply_every(2)),
}
OTHERS.update(
  {
    f"handwritten-state-{c}": functools.partial(_handwritten, c)
    for c in (
      "literal_constant",
      "python_scalar",
      "weak_scalar",
      "typed_key",
      "uint32_key",
      "int_counter",
    )
  }
)
OTHERS["handwritten-state-none"] = functools.partial(_handwritten, "none")
OTHERS["handwritten-needs-value"] = _needs_value
OTHER_EXTRAS = {"handwritten-needs-value": VALUE}

INNERS = (
  [n for n in DISCOVERED if n not in NOT_AN_INNER]
  + [n for n in SPECIAL if n not in DISCOVERED]
  + list(OTHERS)
)


def _make(name):
  """(inner, extra arguments of update) for the inner named ``name``."""
  if name in OTHERS:
    return OTHERS[name](), OTHER_EXTRAS.get(name, NO_EXTRAS)
  if name in SPECIAL:
    factory, extras = SPECIAL[name]
    return factory(), extras
  return _default(name)(), NO_EXTRAS


def test_every_discovered_optimizer_is_covered():
  """A discovered optimizer that is not in a table builds with defaults; table entries exist."""
  failures = {}
  for name in DISCOVERED:
    if name in SPECIAL or name in NOT_AN_INNER:
      continue
    try:
      tx = _default(name)()
    except Exception as e:  # noqa: BLE001
      failures[name] = f"{type(e).__name__}: {e}"
      continue
    if not isinstance(tx, optax.GradientTransformation):
      failures[name] = f"returned a {type(tx).__name__}, not a GradientTransformation"
  assert not failures, (
    "optimizers discovered in optax that do not build with a learning rate alone: add them "
    f"to SPECIAL (with how to build them) or NOT_AN_INNER (with why): {failures}"
  )
  variants = {"sgd-momentum", "sgd-nesterov"}
  stale = sorted((set(SPECIAL) | set(NOT_AN_INNER)) - set(DISCOVERED) - variants)
  assert not stale, f"table entries no longer in optax: {stale}"
  for must in ("adam", "sgd", "lbfgs", "contrib.prodigy", "contrib.mechanize", "contrib.sam"):
    assert must in INNERS, must


# -- types and bits --------------------------------------------------------------------------------


def _aval(x):
  return x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)


def _types(tree):
  """Tree structure and each leaf's (shape, dtype, weak type, Python scalar or array): what
  jax.jit's cache tells apart."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [
    (tuple(a.shape), str(a.dtype), bool(a.weak_type), type(x).__name__ if _python(x) else "array")
    for x, a in zip(leaves, map(_aval, leaves))
  ]


def _python(x):
  return isinstance(x, (bool, int, float, complex))


def _is_key(x):
  return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _bits(tree):
  """Tree structure, and each leaf's dtype, shape and bytes."""
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for x in leaves:
    x = jnp.asarray(x)
    data = np.asarray(jax.random.key_data(x) if _is_key(x) else x)
    out.append((str(x.dtype), data.shape, data.tobytes()))
  return treedef, out


def _paths(tree):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _bit_problems(actual, expected, what):
  """What differs, bit for bit, between two trees: [] when nothing does."""
  (ta, la), (te, le) = _bits(actual), _bits(expected)
  if ta != te:
    return [f"{what}: tree structure changed: {ta} != {te}"]
  leaves = zip(_paths(expected), la, le, jax.tree.leaves(actual), jax.tree.leaves(expected))
  return [
    f"{what}{p}: not bit for bit: {np.asarray(x).tolist()} != {np.asarray(y).tolist()}"
    + ("" if a[0] == e[0] else f" ({a[0]} != {e[0]})")
    for p, a, e, x, y in leaves
    if a != e
  ]


def _rtol(*dtypes):
  return max([1e-6] + [float(jnp.finfo(d).eps) for d in dtypes])


def _close_problems(actual, expected, what, scale=None):
  """Leaf by leaf, what is not close: floating leaves to the rounding of the coarser dtype
  (rtol, and an atol of rtol times the largest magnitude of the leaf, or of its leaf in
  ``scale`` where that is larger, for entries that cancel to about zero); the others exactly.
  [] when all are. Updates take the parameters as ``scale``: an optimizer that computes them
  as a difference of parameter-sized values (schedule_free's) rounds them to the parameters'
  last bit, in which two compilations of the same arithmetic may differ."""
  ta, te = jax.tree.structure(actual), jax.tree.structure(expected)
  if ta != te:
    return [f"{what}: tree structure {ta} != {te}"]
  scales = jax.tree.leaves(expected if scale is None else scale)
  problems = []
  leaves = zip(_paths(expected), jax.tree.leaves(actual), jax.tree.leaves(expected), scales)
  for p, a, e, m in leaves:
    a, e = jnp.asarray(a), jnp.asarray(e)
    try:
      if _is_key(e):
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(e))
      elif jnp.issubdtype(e.dtype, jnp.floating):
        rtol = _rtol(a.dtype, e.dtype)
        e = np.asarray(e, np.float64)
        largest = max(np.max(np.abs(x), initial=0.0) for x in (e, np.asarray(m, np.float64)))
        atol = rtol * largest
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=rtol, atol=atol)
      else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    except AssertionError as err:
      lines = [line.strip() for line in str(err).splitlines() if line.strip()]
      problems.append(f"{what}{p}: " + " | ".join(lines[1:]))
  return problems


# -- the runs --------------------------------------------------------------------------------------
#
# XLA's compile time is most of the zoo's cost, so one jax.jit per inner compiles everything
# for it: each (tree, lowering) case's step, and the bare optimizer's two finite steps on each
# tree. The step is the jitted function that check 3's lax.scan traced, called directly (the
# program reuses that trace, and has no loop to compile). Each step runs both call paths from
# the same state (XLA then shares the work they have in common), the run goes on from the
# tx.update path's state, and the fused path's outputs are checked against their inputs. The
# program is called once per step with each case's carry fed back, so each step's result is
# read from its outputs and the four calls must compile once. A case whose carry's types
# change over a step (seen by tracing it first) would recompile the shared program: it runs
# with the other such cases of its inner, in a jitted step of their own. (One program per
# inner compiles faster than one per case, and, with the suite's XLA options of
# tests/conftest.py, than one for several inners; the bare steps are compiled with the
# wrapped ones, in the same programs.)


def _as_transformation(inner):
  return inner.gradient_transformation() if isinstance(inner, optax.MultiSteps) else inner


def _bare(name, tree):
  """The bare inner on one tree: its state types over BARE_UPDATES updates from its own init
  (traced only), and its two finite steps as a function for the shared program (their first
  state is chosen by _bare_start); or the error it raises."""
  try:
    inner, extras = _make(name)
    inner = optax.with_extra_args_support(_as_transformation(inner))
    params, us = _params(tree), _unscaled_grads(tree)

    def update(u, s, p):
      return inner.update(u, s, p, **extras(p, u))

    def steps(state, params, us):
      out = []
      for k in (1, 3):
        updates, state = update(_step(us, k), state, params)
        params = optax.apply_updates(params, updates)
        out.append((updates, params, state))
      return out

    init = inner.init(params)
    types, abstract = [_types(init)], init
    for _ in range(BARE_UPDATES):
      abstract = jax.eval_shape(update, _step(us, 1), abstract, params)[1]
      types.append(_types(abstract))
  except Exception as e:  # noqa: BLE001
    return dict(error=e)
  return dict(error=None, steps=steps, params=params, us=us, types=types, init=init)


def _bare_start(bare, cases):
  """Sets the bare steps' arguments: from the wrapped init's inner state (which may be widened
  already: check 3 says whether rightly), or from the bare init where that one will not do
  (the wrapped cases report why); or sets the error the bare steps raise from their own init."""
  params, us = bare["params"], bare["us"]
  wrapped = [c["carry0"][1].inner_state for c in cases if c["error"] is None]
  try:
    jax.eval_shape(bare["steps"], wrapped[0], params, us)
    start = wrapped[0]
  except Exception:  # noqa: BLE001 (the wrapped cases report it)
    start = bare["init"]
    try:
      jax.eval_shape(bare["steps"], start, params, us)
    except Exception as e:  # noqa: BLE001
      bare.update(error=e)
      return
  bare.update(args=(start, params, us))


def _program(tx, extras):
  """One step from (params, state) on both call paths: the new (params, state) of the
  tx.update path, and its updates and apply_step's (params, state) as the step's outputs."""

  def one(carry, u):
    params, state = carry
    g = _scaled(u, state)
    updates, new_state = tx.update(g, state, params, **extras(params, u))
    fused = apply_step(tx, g, state, params, **extras(params, u))
    return (optax.apply_updates(params, updates), new_state), (updates, fused)

  return one


def _case(name, tree, skip_lowering):
  """One wrapped case, traced: its first carry, its jitted step, and the carry's types after
  a lax.scan of that step over the four steps (or why that scan cannot be traced). The scan
  traces the step with the carry's types, as the shared program then calls it: the program
  reuses that trace."""
  case = dict(error=None, scan_error=None, scan_types=None)
  try:
    inner, extras = _make(name)
    tx = optax_dls.dynamic_loss_scale(
      inner, init_scale=SCALE, growth_interval=1000, skip_lowering=skip_lowering
    )
    params, us = _params(tree), _unscaled_grads(tree)
    case.update(carry0=(params, tx.init(params)), us=us)
  except Exception as e:  # noqa: BLE001
    return dict(case, error=e)
  step = case["step"] = jax.jit(_program(tx, extras))
  try:  # it raises when a dtype in the carry changes
    carry = jax.eval_shape(lambda carry, us: lax.scan(step, carry, us), case["carry0"], us)[0]
    case["scan_types"] = _types(carry)
  except Exception as e:  # noqa: BLE001
    case["scan_error"] = e
  return case


def _prepare(name):
  """Inner ``name``, traced: {bares: {tree: bare}, cases: {(tree, lowering): case}, keys: the
  cases that can share a program (no error, the carry's types kept over the four steps)}."""
  bares = {tree: _bare(name, tree) for tree in TREES}
  cases = {}
  for tree in TREES:
    if bares[tree]["error"] is None:
      cases.update({(tree, low): _case(name, tree, low) for low in LOWERINGS})
      _bare_start(bares[tree], [cases[(tree, low)] for low in LOWERINGS])
  keys = [
    key for key, c in cases.items() if c["error"] is None and c["scan_types"] == _types(c["carry0"])
  ]
  return dict(bares=bares, cases=cases, keys=keys)


def _alone(cases):
  """The four steps of the cases that cannot share the program, together in their own jitted
  step (each in its own where that fails); a case whose types change recompiles it."""
  if len(cases) > 1 and _alone_together(cases, f"the jitted step of {len(cases)} cases") is None:
    return
  for case in cases:
    if (error := _alone_together([case], "the jitted step")) is not None:
      case.update(error=error)


def _alone_together(cases, program):
  """Runs the four steps of ``cases`` in one jitted step (``program`` names it in reports);
  returns the error it raises, or None."""

  def step(carries, us):
    return [c["step"](carry, u) for c, carry, u in zip(cases, carries, us)]

  step = jax.jit(step)
  carries, steps = [c["carry0"] for c in cases], [[] for _ in cases]
  try:
    for k in range(len(STEPS_FINITE)):
      out = step(carries, [_step(c["us"], k) for c in cases])
      for case_steps, before, (after, ys) in zip(steps, carries, out):
        case_steps.append((before, after, ys))
      carries = [after for after, _ in out]
  except Exception as e:  # noqa: BLE001
    return e
  for case, case_steps in zip(cases, steps):
    case.update(steps=case_steps, program=program, cache_size=step._cache_size())
  return None


def _shared(unit):
  """The four steps of the cases ``unit["keys"]`` of a prepared inner and its bare steps, in
  one jitted program: ({key: [(carry before, carry after, outputs)]}, {tree: bare results},
  its compile count)."""
  cases, bares, keys = unit["cases"], unit["bares"], unit["keys"]

  def program(carries, us, bare_args):
    out = [cases[key]["step"](carry, u) for key, carry, u in zip(keys, carries, us)]
    return out, {t: bares[t]["steps"](*a) for t, a in bare_args.items()}

  bare_args = {t: b["args"] for t, b in bares.items() if b["error"] is None}
  compiled, carries = jax.jit(program), [cases[key]["carry0"] for key in keys]
  steps = {key: [] for key in keys}
  for k in range(len(STEPS_FINITE)):
    us = [_step(cases[key]["us"], k) for key in keys]
    out, bare_results = compiled(carries, us, bare_args)
    for key, before, (after, ys) in zip(keys, carries, out):
      steps[key].append((before, after, ys))
    carries = [after for after, _ in out]
  return steps, bare_results, compiled._cache_size()


@functools.cache
def _zoo(name):
  """Every case of inner ``name``: {tree: bare}, {(tree, lowering): case and its four steps}.
  Never raises: an error is kept for the checks it stops."""
  unit = _prepare(name)
  bares, cases = unit["bares"], unit["cases"]
  try:
    steps, bare_results, cache_size = _shared(unit)
  except Exception:  # noqa: BLE001 (then each case runs alone, and reports its own error)
    steps, cache_size = {}, None
    try:
      bare_results = _shared(dict(unit, keys=[]))[1]
    except Exception as e:  # noqa: BLE001
      bare_results = {}
      for bare in bares.values():
        bare.update(error=bare["error"] or e)
  for tree, bare in bares.items():
    if bare["error"] is None:
      bare["results"] = bare_results[tree]
  for key in steps:
    cases[key].update(steps=steps[key], program="the shared program", cache_size=cache_size)
  _alone([c for key, c in cases.items() if key not in steps and c["error"] is None])
  return bares, cases


def _runs(name, tree, skip_lowering):
  """(bare, case) for one case; skips the case where the bare optimizer cannot step."""
  bares, cases = _zoo(name)
  bare = bares[tree]
  if bare["error"] is not None:
    error = bare["error"]
    pytest.skip(f"the bare optimizer cannot step on this tree: {type(error).__name__}: {error}")
  return bare, cases[(tree, skip_lowering)]


def _steps(case):
  """[(carry before, carry after, (updates, (params, state) of apply_step))] per step."""
  if case["error"] is not None:
    raise case["error"]
  return case["steps"]


def _report(problems):
  if problems:
    pytest.fail("\n".join(problems), pytrace=False)


CASES = pytest.mark.parametrize("skip_lowering", LOWERINGS)
TREE = pytest.mark.parametrize("tree", TREES)
INNER = pytest.mark.parametrize("name", INNERS)


@CASES
@TREE
@INNER
def test_finite_step_matches_bare(name, tree, skip_lowering):
  """init's inner state holds the bare init's values, and each finite step equals the bare
  optimizer's on the unscaled gradients, on both call paths."""
  bare, case = _runs(name, tree, skip_lowering)
  steps = _steps(case)
  problems = _close_problems(case["carry0"][1].inner_state, bare["init"], "init: inner state")
  for k, (b_updates, b_params, b_state) in zip((1, 3), bare["results"]):
    _, (pu, su), (updates, (pf, sf)) = steps[k]
    if not (bool(su.last_step_finite) and bool(sf.last_step_finite)):
      problems.append(f"step {k} was skipped")
    problems += _close_problems(updates, b_updates, f"step {k}: updates", scale=b_params)
    problems += _close_problems(pu, b_params, f"step {k}: params (tx.update)")
    problems += _close_problems(su.inner_state, b_state, f"step {k}: inner state (tx.update)")
    problems += _close_problems(pf, b_params, f"step {k}: params (apply_step)")
    problems += _close_problems(sf.inner_state, b_state, f"step {k}: inner state (apply_step)")
  _report(problems)


@CASES
@TREE
@INNER
def test_skipped_step_is_bit_for_bit(name, tree, skip_lowering):
  """A NaN step from init and an inf step later: parameters and inner state untouched bit for
  bit on both call paths, zero updates of an applied step's types, the scale backed off."""
  _, case = _runs(name, tree, skip_lowering)
  steps, problems = _steps(case), []
  finite = [[bool(s.last_step_finite) for s in (su, sf)] for _, (_, su), (_, (_, sf)) in steps]
  assert finite == [[f, f] for f in STEPS_FINITE], f"finite flags (two call paths): {finite}"
  for k in (0, 2):
    before, after, (updates, fused) = steps[k]
    p_before, s_before = jax.tree.map(jnp.asarray, before)
    for path, (p_after, s_after) in (("tx.update", after), ("apply_step", fused)):
      problems += _bit_problems(p_after, p_before, f"step {k} ({path}): params")
      what = f"step {k} ({path}): inner state"
      problems += _bit_problems(s_after.inner_state, s_before.inner_state, what)
      scales = (
        float(optax_dls.find_state(s_before).loss_scale),
        float(optax_dls.find_state(s_after).loss_scale),
      )
      if scales[1] != scales[0] / 2:
        problems.append(f"step {k} ({path}): the loss scale went {scales[0]} -> {scales[1]}")
    if _types(updates) != _types(steps[1][2][0]):
      problems.append(f"step {k}: the updates' types differ from an applied step's")
    for p, u in zip(_paths(updates), jax.tree.leaves(updates)):
      if np.any(np.asarray(u)):
        problems.append(f"step {k}: updates{p} are not zero: {np.asarray(u).tolist()}")
  _report(problems)


def _settled(types):
  """The first of the bare optimizer's state types that one more update keeps, or None."""
  return next((types[k] for k in range(len(types) - 1) if types[k] == types[k + 1]), None)


def _type_diff(tree, types):
  """Where ``types`` differ from ``tree``'s: [] when nowhere."""
  own = _types(tree)
  if own[0] != types[0]:
    return [f"tree structure {own[0]} -> {types[0]}"]
  return [f"{p}: {a} -> {b}" for p, a, b in zip(_paths(tree), own[1], types[1]) if a != b]


@CASES
@TREE
@INNER
def test_state_types_are_a_fixed_point(name, tree, skip_lowering):
  """From init on, the types of the parameters and the state (shape, dtype, weak type) never
  change: init's inner state has the types the bare optimizer's state settles at, a lax.scan
  over the four steps with them as carry traces to the same types, each step returns them on
  both call paths, and the jitted step compiles once over the four steps."""
  bare, case = _runs(name, tree, skip_lowering)
  settled = _settled(bare["types"])
  if settled is None:
    pytest.skip(f"the bare optimizer's own state types do not settle in {BARE_UPDATES} updates")
  problems, error, carry0 = [], case["scan_error"], case["carry0"]
  if diff := _type_diff(carry0[1].inner_state, settled):
    problems.append(f"init's inner state has not the bare optimizer's settled types: {diff}")
  if error is not None:
    problems.append(f"the lax.scan over the four steps raised {type(error).__name__}: {error}")
  elif diff := _type_diff(carry0, case["scan_types"]):
    problems.append(f"the lax.scan over the four steps changed the carry's types: {diff}")
  for k, (_, after, (_, fused)) in enumerate(_steps(case)):
    for path, carry in (("tx.update", after), ("apply_step", fused)):
      if diff := _type_diff(carry0, _types(carry)):
        problems.append(f"step {k} ({path}) changed the types from init's: {diff}")
  if case["cache_size"] != 1:
    problems.append(f"{case['program']} compiled {case['cache_size']} times in four steps")
  _report(problems)
