"""What the public docstrings (``optax_dls.__all__``) promise: each Raises clause raises the
exception it names, and the Args/Returns sentences no other test holds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dls
from optax_dls import _policies

P = {"w": jnp.ones(2)}
SGD = optax.sgd(1.0)


def _tx():
  return optax_dls.dynamic_loss_scale(SGD)


def _state():
  return _tx().init(P)


def _loss(p):
  return jnp.sum(p["w"])


def _policy(init=lambda: (jnp.float32(2.0), ()), update=lambda s, st, g: (s, st), **kw):
  return optax_dls.LossScalePolicy(init, update, **kw)


def _traced_update(policy):
  tx = optax_dls.loss_scaled(SGD, policy)
  return tx.update(P, tx.init(P))


# (public name, the call, the exception its docstring's Raises names, a part of the message)
RAISES = [
  ("cast_policy", lambda: optax_dls.cast_policy(1), TypeError, "must be a string"),
  ("cast_policy", lambda: optax_dls.cast_policy("p=f32, c=f16"), ValueError, "Unknown key"),
  ("full_precision", lambda: optax_dls.full_precision(3), TypeError, "fn must be callable"),
  (
    "full_precision",
    lambda: optax_dls.full_precision(_loss, output_dtype=3),
    TypeError,
    "output_dtype must be a dtype",
  ),
  (
    "full_precision",
    lambda: optax_dls.full_precision(_loss, output_dtype=jnp.int32),
    ValueError,
    "floating dtype",
  ),
  (
    "LossScalePolicy",
    lambda: optax_dls.loss_scaled(SGD, _policy(min_scale=4.0)),
    ValueError,
    r"\[min_scale, max_scale\]",
  ),
  (
    "LossScalePolicy",
    lambda: optax_dls.loss_scaled(SGD, _policy(lambda: (jnp.float32(2.0), "x"))),
    TypeError,
    "must be a pytree of arrays",
  ),
  (
    "LossScalePolicy",
    lambda: optax_dls.loss_scaled(SGD, _policy(passthrough=True)),
    ValueError,
    "passthrough=True must start at loss scale 1",
  ),
  (
    "LossScalePolicy",
    lambda: _traced_update(_policy(update=lambda s, st, g: s)),
    TypeError,
    r"must return a \(loss_scale, policy_state\) pair",
  ),
  (
    "LossScalePolicy",
    lambda: _traced_update(_policy(update=lambda s, st, g: (jnp.ones(2), st))),
    TypeError,
    "floating loss scale of shape",
  ),
  (
    "LossScalePolicy",
    lambda: _traced_update(
      _policy(lambda: (jnp.float32(2.0), jnp.int32(0)), lambda s, n, g: (s, n * 1.0))
    ),
    TypeError,
    "shapes and dtypes of policy.init",
  ),
  ("SkipAlerts", lambda: optax_dls.SkipAlerts(True), TypeError, "must be an integer"),
  ("SkipAlerts", lambda: optax_dls.SkipAlerts(2.0), TypeError, "must be an integer"),
  ("SkipAlerts", lambda: optax_dls.SkipAlerts(0), ValueError, "alert_after=0"),
  ("SkipAlerts", lambda: optax_dls.SkipAlerts(2**31), ValueError, "alert_after=2147483648"),
  ("all_finite", lambda: optax_dls.all_finite({"a": "x"}), TypeError, r"tree\['a'\]"),
  ("all_finite", lambda: optax_dls.all_finite(P, axis_name=3), TypeError, "axis_name"),
  ("amax_policy", lambda: optax_dls.amax_policy(margin=65), ValueError, "margin=65"),
  ("amax_policy", lambda: optax_dls.amax_policy(max_value=1e39), ValueError, "max_value"),
  ("amax_policy", lambda: optax_dls.amax_policy(history_len=2.0), TypeError, "history_len"),
  (
    "dynamic_loss_scale",
    lambda: optax_dls.dynamic_loss_scale(SGD, hysteresis=0),
    ValueError,
    "hysteresis",
  ),
  (
    "dynamic_policy",
    lambda: optax_dls.dynamic_policy(consecutive_hysteresis=1),
    TypeError,
    "must be a bool",
  ),
  ("find_state", lambda: optax_dls.find_state(SGD.init(P)), ValueError, "no LossScaleState"),
  ("find_state", lambda: optax_dls.find_state((_state(), _state())), ValueError, "2 LossScale"),
  (
    "find_state",
    lambda: optax_dls.find_state(optax.MultiSteps(_tx(), 2).init(P)),
    ValueError,
    "MultiSteps",
  ),
  ("fp32_fallback", lambda: optax_dls.fp32_fallback("x"), TypeError, "LossScalePolicy"),
  (
    "fp32_fallback",
    lambda: optax_dls.fp32_fallback(optax_dls.dynamic_policy(), scale=0.5),
    ValueError,
    "scale=0.5",
  ),
  ("locate", lambda: optax_dls.locate(3, P), TypeError, "fun must be callable"),
  ("locate", lambda: optax_dls.locate(_loss, P, scale="1"), TypeError, "scale"),
  ("locate", lambda: optax_dls.locate(_loss, P, has_aux=1), TypeError, "has_aux"),
  ("locate", lambda: optax_dls.locate(_loss, P, scale=0.0), ValueError, "scale=0.0"),
  ("locate", lambda: optax_dls.locate(_loss, P, argnums=1), ValueError, "argnums=1"),
  ("loss_scaled", lambda: optax_dls.loss_scaled(3, optax_dls.dynamic_policy()), TypeError, "inner"),
  ("loss_scaled", lambda: optax_dls.loss_scaled(SGD, 3), TypeError, "policy"),
  (
    "loss_scaled",
    lambda: optax_dls.loss_scaled(SGD, optax_dls.dynamic_policy(), skip_lowering=3),
    TypeError,
    "skip_lowering",
  ),
  (
    "loss_scaled",
    lambda: optax_dls.loss_scaled(SGD, optax_dls.dynamic_policy(), skip_lowering="x"),
    ValueError,
    "skip_lowering",
  ),
  (
    "loss_scaled",
    lambda: optax_dls.loss_scaled(SGD, optax_dls.dynamic_policy(), labels={"w": 3}),
    TypeError,
    "labels must be strings",
  ),
  (
    "loss_scaled",
    lambda: optax_dls.loss_scaled(SGD, optax_dls.dynamic_policy(), labels={"w": "a/b"}),
    ValueError,
    "without '/'",
  ),
  (
    "loss_scaled",
    lambda: optax_dls.loss_scaled(SGD, optax_dls.dynamic_policy(), labels={"v": "a"}).init(P),
    ValueError,
    "do not match",
  ),
  (
    "loss_scaled",
    lambda: jax.jit(optax_dls.dynamic_loss_scale(SGD, axis_name="data").update)(P, _state(), P),
    ValueError,
    "'data' is not a mapped axis",
  ),
  ("metrics", lambda: optax_dls.metrics((_state(), _state())), ValueError, "2 LossScale"),
  ("no_loss_scale", lambda: optax_dls.no_loss_scale(3), TypeError, "inner"),
  (
    "no_loss_scale",
    lambda: optax_dls.no_loss_scale(SGD, track_grad_norm=1),
    TypeError,
    "track_grad_norm",
  ),
  ("nonfinite_leaves", lambda: optax_dls.nonfinite_leaves(_state(), None), TypeError, "params"),
  ("nonfinite_leaves", lambda: optax_dls.nonfinite_leaves({}, P), ValueError, "no LossScale"),
  ("reset_scale", lambda: optax_dls.reset_scale(_state(), float("nan")), ValueError, "NaN"),
  ("reset_scale", lambda: optax_dls.reset_scale(_state(), 0.0), ValueError, "value=0.0"),
  ("reset_scale", lambda: optax_dls.reset_scale(_state(), jnp.ones(2)), ValueError, "shape"),
  ("reset_scale", lambda: optax_dls.reset_scale(_state(), "2"), TypeError, "real number"),
  ("scale_loss", lambda: optax_dls.scale_loss(None, _state()), TypeError, "floating-point"),
  ("scale_loss", lambda: optax_dls.scale_loss(jnp.float32(1), {}), ValueError, "no LossScale"),
  (
    "fp32_fallback",
    lambda: optax_dls.fp32_fallback(_policy(passthrough=1)),
    TypeError,
    "policy.passthrough must be a bool",
  ),
  (
    "fp32_fallback",
    lambda: optax_dls.fp32_fallback(_policy(stats=("foo",))),
    ValueError,
    "policy.stats",
  ),
  (
    "fp32_fallback",
    lambda: optax_dls.fp32_fallback(_policy(min_scale=0.0)),
    ValueError,
    "policy.min_scale",
  ),
  (
    "fp32_fallback",
    lambda: optax_dls.fp32_fallback(_policy(min_scale=4.0)),
    ValueError,
    r"policy.init\(\)",
  ),
  ("static_loss_scale", lambda: optax_dls.static_loss_scale(SGD, 0.0), ValueError, "scale=0.0"),
  (
    "static_loss_scale",
    lambda: jax.jit(lambda s: optax_dls.static_loss_scale(SGD, s).init(P))(jnp.float32(2.0)),
    TypeError,
    "static Python number",
  ),
  (
    "underflow_stats",
    lambda: optax_dls.underflow_stats({"w": "zero_frac"}),
    ValueError,
    "other than",
  ),
  ("underflow_stats", lambda: optax_dls.underflow_stats({"w": 3}), TypeError, "strings"),
  ("underflow_stats", lambda: optax_dls.underflow_stats(axis_name=3), TypeError, "axis_name"),
  ("value_and_grad", lambda: optax_dls.value_and_grad(3, _tx()), TypeError, "fun must"),
  ("value_and_grad", lambda: optax_dls.value_and_grad(_loss, SGD), TypeError, "loss-scaled"),
  (
    "value_and_grad",
    lambda: optax_dls.value_and_grad(_loss, _tx(), max_tries=1.0),
    TypeError,
    "max_tries",
  ),
  (
    "value_and_grad",
    lambda: optax_dls.value_and_grad(_loss, _tx(), max_tries=65),
    ValueError,
    "max_tries",
  ),
  (
    "value_and_grad",
    lambda: optax_dls.value_and_grad(_loss, _tx(), argnums=(0, 0)),
    ValueError,
    "repeat",
  ),
  (
    "value_and_grad",
    lambda: optax_dls.value_and_grad(_loss, _tx())(P, _state()),
    ValueError,
    "look swapped",
  ),
  (
    "value_and_grad",
    lambda: optax_dls.value_and_grad(_loss, _tx(), has_aux=True)(_state(), P),
    TypeError,
    r"\(loss, aux\) pair",
  ),
]


@pytest.mark.parametrize(
  "name,call,error,match", RAISES, ids=[f"{r[0]}-{i}" for i, r in enumerate(RAISES)]
)
def test_each_raises_clause_of_a_public_docstring_raises_its_exception(name, call, error, match):
  assert name in optax_dls.__all__
  with pytest.raises(error, match=match):
    call()


def test_value_and_grad_refuses_an_fp32_fun_whose_output_has_another_structure():
  """``fp32_fun`` returning its ``aux`` in another container (a list for a tuple) is refused
  as its docstring says, not rebuilt silently in ``fun``'s structure."""

  def fun(p):
    return jnp.sum(p["w"]), (jnp.ones(2),)

  def fp32_fun(p):
    return jnp.sum(p["w"]), [jnp.ones(2)]

  grad_fn = optax_dls.value_and_grad(fun, _tx(), has_aux=True, fp32_fun=fp32_fun)
  with pytest.raises(ValueError, match="fun and fp32_fun must return the same pytree structure"):
    grad_fn(_state(), P)


def test_a_fresh_state_and_its_metrics_read_as_documented():
  """``LossScaleState`` and ``metrics`` before the first step: applied, no norm, no record
  (an int32 ``[n + 2]`` of zeros), no overflows without labels; the bit sets of ``metrics``
  have ``ceil(leaves / 32)`` words, at least 1."""
  state = _state()
  assert bool(state.last_step_finite) and np.isnan(float(state.grad_norm))
  assert state.nonfinite.dtype == jnp.int32 and state.nonfinite.shape == (3,)
  assert not np.any(state.nonfinite) and state.overflows == {}
  m = optax_dls.metrics(state)
  assert float(m["update_ratio"]) == 1.0 and int(m["nonfinite_step"]) == 0
  dtypes = {k: v.dtype for k, v in m.items()}
  assert dtypes["loss_scale"] == jnp.float32 and dtypes["skipped"] == jnp.bool_
  assert dtypes["nonfinite_leaves"] == dtypes["nonfinite_nan"] == jnp.uint32
  for leaves, words in ((0, 1), (1, 1), (32, 1), (33, 2)):
    params = {f"p{i}": jnp.ones(1) for i in range(leaves)} | {"i": jnp.ones(1, jnp.int32)}
    assert optax_dls.metrics(_tx().init(params))["nonfinite_leaves"].shape == (words,)


def test_the_transformation_is_optax_s_own_pair_of_functions():
  """``loss_scaled`` returns a plain ``optax.GradientTransformationExtraArgs`` of ``init``
  and ``update``: nothing more to it, and replacing ``init`` keeps it working."""
  tx = _tx()
  assert type(tx) is optax.GradientTransformationExtraArgs and len(tx) == 2
  kept = tx._replace(init=tx.init)
  updates, state = kept.update({"w": jnp.full(2, 2.0**15)}, kept.init(P), P)
  np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])
  assert bool(state.last_step_finite)


def test_a_skipped_step_gives_integer_leaves_plain_zeros_and_floats_negative_zeros():
  """``loss_scaled`` step 3: the skipped updates have the applied step's types."""
  tx = optax_dls.static_loss_scale(optax.identity(), 4.0)
  params = {"f": jnp.ones(2), "i": jnp.array([1], jnp.int32), "n": None}
  state = tx.init(params)
  grads = {"f": jnp.array([4.0, 8.0]), "i": jnp.array([3], jnp.int32), "n": None}
  applied, _ = tx.update(grads, state, params)
  np.testing.assert_array_equal(applied["f"], [1.0, 2.0])
  assert applied["i"].dtype == jnp.int32 and int(applied["i"][0]) == 3  # passed through
  skipped, _ = tx.update(dict(grads, f=jnp.array([jnp.inf, 8.0])), state, params)
  assert skipped["f"].dtype == jnp.float32 and np.signbit(skipped["f"]).all()
  assert skipped["i"].dtype == jnp.int32 and not np.any(skipped["i"])
  assert skipped["n"] is None


def test_grad_stats_count_every_step_and_norm_the_unscaled_gradients():
  """``GradStats``: ``finite`` is the step's decision, the loss included; ``step`` counts the
  updates before this one, skipped included; ``grad_norm`` is the unscaled gradients' norm
  (inf when they are not finite, finite when the loss alone was not); ``amax`` is the scaled
  gradients' and ``None`` unless the policy's ``stats`` ask for it."""

  def init():
    return jnp.float32(4.0), (jnp.bool_(True), jnp.int32(-1), jnp.float32(0), jnp.float32(0))

  def update(scale, state, stats):
    amax = jnp.float32(-1.0) if stats.amax is None else stats.amax
    return scale, (stats.finite, stats.step, stats.grad_norm, amax)

  nan = jnp.float32(np.nan)
  seen = []
  for asked in ((), ("amax",)):
    tx = optax_dls.loss_scaled(SGD, _policy(init, update, stats=asked))
    state = tx.init(P)
    for grads, loss in (([12.0, -16.0], None), ([np.inf, 1.0], None), ([12.0, -16.0], nan)):
      _, state = tx.update({"w": jnp.array(grads)}, state, loss=loss)
      seen.append(tuple(float(x) for x in state.policy_state))
  assert seen == [
    (1.0, 0.0, 5.0, -1.0),
    (0.0, 1.0, np.inf, -1.0),
    (0.0, 2.0, 5.0, -1.0),
    (1.0, 0.0, 5.0, 16.0),
    (0.0, 1.0, np.inf, np.inf),
    (0.0, 2.0, 5.0, 16.0),
  ]


def test_static_loss_scale_keeps_the_dynamic_policy_s_layout():
  """``static_loss_scale``: the state is the dynamic policy's layout, held constant."""
  static = optax_dls.static_loss_scale(SGD, 4.0).init(P)
  dynamic = _state()
  assert jax.tree.structure(static) == jax.tree.structure(dynamic)
  assert [x.dtype for x in jax.tree.leaves(static)] == [x.dtype for x in jax.tree.leaves(dynamic)]
  _, static = optax_dls.static_loss_scale(SGD, 4.0).update({"w": jnp.ones(2)}, static, P)
  assert float(static.loss_scale) == 4.0


def test_all_finite_reads_complex_leaves_and_numpy_float64_as_jax_converts_it():
  """``all_finite``: a complex inf counts; without x64 a NumPy float64 past float32's range
  becomes inf first."""
  assert not bool(optax_dls.all_finite({"c": jnp.array([1 + 1j, complex(np.inf, 0.0)])}))
  assert bool(optax_dls.all_finite({"c": jnp.array([1 + 1j, 3e38 + 0j])}))
  if not jax.config.jax_enable_x64:
    with pytest.warns(RuntimeWarning, match="overflow"):  # NumPy's, casting to float32
      assert not bool(optax_dls.all_finite({"x": np.array([1e39])}))


def test_a_logged_row_is_checked_only_as_far_as_its_bits_allow():
  """``nonfinite_leaves`` on a dict of ``metrics`` (a logged row): a tree with too few leaves
  for the bits set is refused; one that fits the bits cannot be told apart."""
  tx = _tx()
  _, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, tx.init(P), P)
  row = {k: v for k, v in jax.device_get(optax_dls.metrics(state)).items()}
  assert optax_dls.nonfinite_leaves(row, P) == {"w": "inf"}
  with pytest.raises(ValueError, match="do not fit the record"):
    optax_dls.nonfinite_leaves(row, {f"p{i}": jnp.ones(1) for i in range(33)})  # 2 words
  assert optax_dls.nonfinite_leaves(row, {"a": jnp.ones(1), "b": jnp.ones(1)}) == {"a": "inf"}


def test_nonfinite_leaves_reads_shapes_and_names_only_floating_leaves():
  """``nonfinite_leaves``: complex leaves are named, integer, bool and ``None`` ones are not;
  ``jax.ShapeDtypeStruct`` stands for an array."""
  params = {
    "c": jnp.ones(1, jnp.complex64),
    "i": jnp.ones(1, jnp.int32),
    "b": jnp.array([True]),
    "n": None,
    "h": jnp.ones(2, jnp.float16),
  }
  tx = optax_dls.dynamic_loss_scale(optax.identity())
  grads = dict(
    params, c=jnp.array([jnp.nan], jnp.complex64), h=jnp.array([1, jnp.inf], jnp.float16)
  )
  _, state = tx.update(grads, tx.init(params), params)
  shapes = jax.eval_shape(lambda: params)
  assert optax_dls.nonfinite_leaves(state, shapes) == {"c": "nan", "h": "inf"}
  assert optax_dls.nonfinite_leaves(state, params) == {"c": "nan", "h": "inf"}


@pytest.mark.parametrize(
  "labels",
  [{"enc": "e", "dec": "d"}, lambda p: {"enc": {"a": "e", "b": "e"}, "dec": "d"}],
  ids=["prefix", "callable"],
)
def test_labels_count_the_non_finite_steps_of_each_group(labels):
  """``loss_scaled(labels=)``: ``overflows/<label>`` counts the skipped steps in which a leaf
  of that group was not finite; a non-finite loss alone counts in no group."""
  params = {"enc": {"a": jnp.ones(2), "b": jnp.ones(1)}, "dec": jnp.ones(3)}
  tx = optax_dls.dynamic_loss_scale(SGD, labels=labels)
  state = tx.init(params)
  ones = jax.tree.map(jnp.ones_like, params)
  steps = [
    (dict(ones, dec=jnp.array([np.inf, 1.0, 1.0])), None),
    (dict(ones, enc={"a": jnp.array([np.nan, 1.0]), "b": jnp.array([np.inf])}), None),
    (ones, jnp.float32(np.nan)),
    (ones, None),
    (jax.tree.map(lambda x: x * np.inf, ones), None),
  ]
  seen = []
  for grads, loss in steps:
    _, state = tx.update(grads, state, params, loss=loss)
    m = optax_dls.metrics(state)
    seen.append((bool(m["skipped"]), int(m["overflows/e"]), int(m["overflows/d"])))
  assert seen == [(True, 0, 1), (True, 1, 1), (True, 1, 1), (False, 1, 1), (True, 2, 2)]


def test_locate_multiplies_a_float16_loss_by_the_scale_in_float32():
  """``locate``'s ``scale``: multiplied as ``scale_loss`` does, so ``S * loss`` past float16's
  range is no overflow of its own."""
  w = jnp.full(4, 250.0, jnp.float16)  # loss 1000 in float16; S * loss = 2**15 * 1000
  assert not bool(jnp.isfinite(jnp.sum(w) * jnp.float16(2.0**15)))
  assert optax_dls.locate(lambda w: jnp.sum(w), w, scale=2.0**15).first is None


def test_reset_scale_of_a_train_state_is_kept_in_range_by_the_next_update():
  """``reset_scale`` checks only that ``value`` is a valid scale; the next update of the
  transformation keeps the scale within its range."""
  train_state = pytest.importorskip("flax.training.train_state")
  tx = optax_dls.dynamic_loss_scale(SGD, max_scale=2.0**16)
  state = optax_dls.reset_scale(
    train_state.TrainState.create(apply_fn=None, params=P, tx=tx), 2.0**20
  )
  assert float(optax_dls.find_state(state).loss_scale) == 2.0**20
  state = state.apply_gradients(grads={"w": jnp.full(2, 2.0**20)})
  assert float(optax_dls.find_state(state).loss_scale) == 2.0**16
  np.testing.assert_array_equal(state.params["w"], [0.0, 0.0])  # unscaled by 2**20


def _steps(tx):
  params = {"w": jnp.ones(2)}
  state, out = tx.init(params), []
  for g in ([1.0, 2.0], [np.inf, 1.0], [1.0, 2.0], [1.0, 2.0]):
    updates, state = tx.update(
      {"w": jnp.array(g) * optax_dls.find_state(state).loss_scale}, state, params
    )
    out.append(updates["w"])
  return jax.device_get((out, state))


def test_dynamic_and_static_loss_scale_are_shorthands_for_loss_scaled():
  """``dynamic_loss_scale(inner, **kw)`` is ``loss_scaled(inner, dynamic_policy(**kw))``, and
  ``static_loss_scale(inner, s)`` is ``loss_scaled(inner, static_policy(s))`` (the private
  policy behind it): same updates,
  same states, bit for bit."""
  kw = dict(init_scale=8.0, growth_interval=2, hysteresis=1, max_scale=16.0)
  pairs = [
    (
      optax_dls.dynamic_loss_scale(SGD, **kw),
      optax_dls.loss_scaled(SGD, optax_dls.dynamic_policy(**kw)),
    ),
    (
      optax_dls.static_loss_scale(SGD, 4.0),
      optax_dls.loss_scaled(SGD, _policies.static_policy(4.0)),
    ),
  ]
  for short, long in pairs:
    a, b = _steps(short), _steps(long)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize(
  "name,refused,accepted",
  [
    ("growth_factor", 1 + 5e-8, 1 + 7e-8),  # "not within ~6e-8 of 1"
    ("backoff_factor", 1 - 2.9e-8, 1 - 3.1e-8),  # "not within ~3e-8 of 1"
    ("backoff_factor", 0.6e-45, 1e-45),  # "nor below ~1e-45"
  ],
)
def test_dynamic_policy_factor_bounds_are_where_its_docstring_puts_them(name, refused, accepted):
  with pytest.raises(ValueError, match=f"{name}=.*in float32"):
    optax_dls.dynamic_policy(**{name: refused})
  optax_dls.dynamic_policy(**{name: accepted})


def test_metrics_keys_of_every_feature_have_their_documented_dtypes_and_shapes():
  """``metrics``: every value is a 0-d array except the two bit sets, each key of the dtype
  its docstring gives, the features' keys included."""
  policy = optax_dls.fp32_fallback(optax_dls.dynamic_policy())
  inner = optax.chain(optax_dls.underflow_stats({"w": "a"}), optax_dls.recompute_stats(), SGD)
  tx = optax_dls.loss_scaled(inner, policy, labels={"w": "g"})
  m = optax_dls.metrics(tx.init(P))
  f32, i32, u32, b = jnp.float32, jnp.int32, jnp.uint32, jnp.bool_
  documented = {
    "loss_scale": f32,
    "skipped": b,
    "skip_count": i32,
    "consecutive_skips": i32,
    "num_steps": i32,
    "update_ratio": f32,
    "grad_norm": f32,
    "nonfinite_step": i32,
    "nonfinite_loss": b,
    "nonfinite_leaves": u32,
    "nonfinite_nan": u32,
    "overflows/g": i32,
    "fp32_fallback": b,
    "skips_at_min_scale": i32,
    "underflow/zero_frac": f32,
    "underflow/subnormal_frac": f32,
    "underflow/a/zero_frac": f32,
    "underflow/a/subnormal_frac": f32,
    "recomputed_steps": i32,
    "recompute_tries": i32,
  }
  assert {k: v.dtype for k, v in m.items()} == documented
  bits = ("nonfinite_leaves", "nonfinite_nan")
  assert all(v.shape == () for k, v in m.items() if k not in bits)
  assert all(m[k].shape == (1,) for k in bits)


def test_the_end_of_the_fp32_fallback_restarts_the_wrapped_policy_s_state():
  """``fp32_fallback``: on the update that ends the fallback the scale restarts at ``scale``
  and the wrapped policy's state at its initial value (the hysteresis refilled)."""
  dynamic = optax_dls.dynamic_policy(init_scale=64.0, hysteresis=3)
  policy = optax_dls.fp32_fallback(dynamic, after=3, steps=2, scale=8.0)
  tx = optax_dls.loss_scaled(SGD, policy)
  state = tx.init(P)
  seen = []
  for g in [np.inf] * 3 + [1.0] * 2:
    _, state = tx.update({"w": jnp.full(2, g)}, state, P)
    fallback = state.policy_state
    inner = fallback.policy_state.policy_state  # inside the count of skips at the minimum
    seen.append((float(state.loss_scale), bool(fallback.fp32_fallback), int(inner.hysteresis_left)))
  assert seen[2] == (32.0, True, 0)  # the third skip backs off and starts the fallback
  assert seen[-1] == (8.0, False, 3)
  assert int(inner.growth_tracker) == int(dynamic.init()[1].growth_tracker) == 0


def test_value_and_grad_traces_fun_three_times_and_compiles_once():
  """``value_and_grad``'s Cost: ``fun`` is traced for its output types, the first pass and the
  loop (twice when no retry can run), and the step compiles once over steps that overflow
  and steps that do not."""
  traces = []

  def loss(p, x):
    traces.append(1)
    return jnp.sum(p["w"].astype(jnp.float16) * x.astype(jnp.float16))

  for max_tries, expected in ((3, 3), (0, 2)):
    traces.clear()
    tx = optax_dls.dynamic_loss_scale(SGD, init_scale=2.0**15)
    grad_fn = jax.jit(optax_dls.value_and_grad(loss, tx, max_tries=max_tries))
    state = tx.init(P)
    for x in (1.0, 4.0, 1.0):  # the float16 gradient 4 * 2**15 overflows
      (_, _), state = grad_fn(state, P, jnp.float32(x))
    assert len(traces) == expected and grad_fn._cache_size() == 1
    if max_tries:
      assert float(optax_dls.find_state(state).loss_scale) < 2.0**15  # the overflow was recomputed


def test_find_state_of_an_nnx_optimizer_is_a_new_state_of_plain_arrays():
  """``find_state``: an ``nnx.Optimizer`` or its ``opt_state`` holds the state in
  ``nnx.Variable``s; it comes back as plain arrays, and ``opt_state`` is left as it was."""
  nnx = pytest.importorskip("flax.nnx")
  optimizer = nnx.Optimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _tx(), wrt=nnx.Param)
  for held in (optimizer, optimizer.opt_state):
    state = optax_dls.find_state(held)
    assert isinstance(state, optax_dls.LossScaleState)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
  assert any(
    isinstance(x, nnx.Variable)
    for x in jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def test_all_finite_reads_each_leaf_once_without_a_conditional():
  """``all_finite``'s Cost: one read of each leaf, one variadic reduction each, with no
  conditional and no entry-by-entry check."""
  tree = {"a": jnp.ones(3), "b": jnp.ones((2, 2), jnp.float16)}
  eqns = jax.make_jaxpr(optax_dls.all_finite)(tree).eqns
  assert "cond" not in [e.primitive.name for e in eqns]
  reads = [e for e in eqns if e.primitive.name == "reduce"]
  assert sorted(e.invars[0].aval.shape for e in reads) == [(2, 2), (3,)]
  finite_of = [e for e in eqns if e.primitive.name == "is_finite"]  # on the per-leaf results
  assert finite_of and all(e.invars[0].aval.size <= len(tree) for e in finite_of)


def test_a_traced_nan_reset_makes_the_next_step_skip_and_restart_at_the_initial_scale():
  """``reset_scale``: a traced NaN is not refused; the next update skips and restarts."""
  tx = optax_dls.dynamic_loss_scale(SGD, init_scale=8.0)
  state = jax.jit(optax_dls.reset_scale)(tx.init(P), jnp.float32(np.nan))
  assert np.isnan(float(state.loss_scale))
  updates, state = tx.update(P, state, P)
  assert not bool(state.last_step_finite) and not np.any(updates["w"])
  assert float(state.loss_scale) == 8.0


def test_the_unscale_multiplies_by_the_float32_reciprocal_of_the_scale():
  """``loss_scaled`` step 1: ``u = grads * (1/S)`` in float32, cast to the leaf's dtype; with
  S = 3 that differs from ``grads / S`` in a third of the entries."""
  rng = np.random.default_rng(0)
  g32 = (rng.standard_normal(300) * 100).astype(np.float32)
  g16 = (rng.standard_normal(300) * 100).astype(np.float16)
  tx = optax_dls.static_loss_scale(optax.identity(), 3.0)
  params = {"a": jnp.zeros(300), "b": jnp.zeros(300, jnp.float16)}
  u, _ = tx.update({"a": jnp.asarray(g32), "b": jnp.asarray(g16)}, tx.init(params), params)
  inv = np.float32(1.0 / 3.0)
  np.testing.assert_array_equal(u["a"], g32 * inv)
  np.testing.assert_array_equal(u["b"], (g16.astype(np.float32) * inv).astype(np.float16))
  assert u["b"].dtype == jnp.float16 and not np.array_equal(u["a"], g32 / np.float32(3.0))


def test_amax_history_is_newest_first_and_an_overflow_enters_max_value_over_s():
  """``amax_policy``: the history holds the unscaled statistic, newest first, 0 in an empty
  slot; a finite step with ``T < S`` backs off to ``T`` at once; an overflow at S backs off
  and enters ``max_value / S``."""
  policy = optax_dls.amax_policy(init_scale=2.0**15, margin=2, history_len=4)
  tx = optax_dls.loss_scaled(SGD, policy)
  state = tx.init(P)
  np.testing.assert_array_equal(state.policy_state.amax_history, [0.0] * 4)
  _, state = tx.update({"w": jnp.array([2.0**15 * 4.0, 0.0])}, state)  # unscaled amax 4
  # T = pow2_floor(65504 / 2**2 / 4) = 2**11
  np.testing.assert_array_equal(state.policy_state.amax_history, [4.0, 0.0, 0.0, 0.0])
  assert float(state.loss_scale) == 2.0**11
  _, state = tx.update({"w": jnp.array([np.inf, 0.0])}, state)
  np.testing.assert_array_equal(state.policy_state.amax_history, [65504.0 / 2**11, 4.0, 0, 0])
  assert float(state.loss_scale) == 2.0**10
  assert state.policy_state.amax_history.dtype == jnp.float32
