"""locate: the first operation that made an inf or NaN (phase, scope, source line) and
each scope's headroom, for a linen model, an nnx model and a function with named scopes."""

import functools
import inspect
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compat import requires_jax

import optax_dls

F16 = jnp.float16


def _line(fun, text):
  """``file:line`` of the line of ``fun`` (defined here) that contains ``text``."""
  lines, start = inspect.getsourcelines(fun)
  offset = next(i for i, line in enumerate(lines) if text in line)
  return f"{__file__}:{start + offset}"  # every function given is in this file


def two_layers(w, x):
  with jax.named_scope("first"):
    h = x @ w["first"]
  with jax.named_scope("second"):
    h = h @ w["second"]
  return jnp.sum(h.astype(jnp.float32))


def _two_layer_args(first, second):
  w = {"first": jnp.full((4, 4), first, F16), "second": jnp.full((4, 4), second, F16)}
  return w, jnp.full((2, 4), 0.01, F16)


def test_forward_overflow_in_named_scope_found_with_scope_and_source():
  w, _ = _two_layer_args(1.0, 2.0e4)  # with x = 1: 4 after "first", 4 * 4 * 2e4 after "second"
  report = optax_dls.locate(two_layers, w, jnp.full((2, 4), 1.0, F16), scale=1.0)
  first = report.first
  assert (first.phase, first.primitive, first.scope, first.kind) == (
    "forward",
    "dot_general",
    "second",
    "inf",
  )
  assert first.source == _line(two_layers, 'h @ w["second"]')
  assert first.dtype == "float16" and first.input_max == 2.0e4
  assert report.headroom[0].scope == "second" and report.headroom[0].forward_overflow


def test_backward_overflow_only_at_large_scale_found_as_backward():
  args = _two_layer_args(1.0, 64.0)
  # The cotangent of "first"'s output is S * 4 * 64: 16384 at S=64, inf at S=4096.
  low = optax_dls.locate(two_layers, *args, scale=64.0)
  assert low.first is None
  assert low.headroom[0].scope == "second"  # the layer that overflows first ranks first
  assert low.headroom[0].backward_fraction == pytest.approx(16384 / 65504, rel=1e-3)
  high = optax_dls.locate(two_layers, *args, scale=4096.0)
  first = high.first
  assert (first.phase, first.scope, first.kind) == ("backward", "second", "inf")
  assert first.source == _line(two_layers, 'h @ w["second"]')
  assert high.headroom[0].scope == "second" and high.headroom[0].backward_overflow
  assert not high.headroom[0].forward_overflow


def test_nan_reported_as_nan():
  def root(w):
    with jax.named_scope("root"):
      return jnp.sum(jnp.sqrt(w - 2.0).astype(jnp.float32))

  first = optax_dls.locate(root, jnp.ones(3, F16), scale=1.0).first
  assert (first.phase, first.primitive, first.scope, first.kind) == (
    "forward",
    "sqrt",
    "root",
    "nan",
  )


def test_finite_step_reports_none_and_the_report_is_json_ready(capsys):
  report = optax_dls.locate(two_layers, *_two_layer_args(0.1, 0.1), scale=2.0**10)
  assert report.first is None
  data = json.loads(json.dumps(report.to_dict()))
  assert data["first"] is None and data["scale"] == 1024.0
  assert {row["scope"] for row in data["headroom"]} >= {"first", "second"}
  print(report)
  assert "every value finite" in capsys.readouterr().out


def test_nested_jit_remat_and_cond_are_entered():
  @jax.jit
  def layer(w, x):
    with jax.named_scope("inner"):
      return jax.checkpoint(lambda x: x @ w)(x)

  def loss(w, x):
    h = jax.lax.cond(True, lambda h: layer(w, h), lambda h: h, x)
    return jnp.sum(h.astype(jnp.float32))

  report = optax_dls.locate(loss, jnp.full((4, 4), 2.0e4, F16), jnp.ones((2, 4), F16), scale=1.0)
  assert (report.first.primitive, report.first.scope, report.first.note) == (
    "dot_general",
    "inner",
    "",
  )


def test_scan_is_reported_as_the_place_with_a_note():
  def loss(w):
    h, _ = jax.lax.scan(lambda h, _: (h * w, None), jnp.ones(2, F16), None, length=4)
    return jnp.sum(h.astype(jnp.float32))

  first = optax_dls.locate(loss, jnp.full(2, 100.0, F16), scale=1.0).first
  assert first.primitive == "scan" and "scan" in first.note and first.phase == "forward"


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [({"scale": 0.0}, "scale"), ({"scale": float("inf")}, "scale"), ({"argnums": 2}, "argnums")],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optax_dls.locate(two_layers, *_two_layer_args(1.0, 1.0), **kwargs)
  with pytest.raises(TypeError, match="fun"):
    optax_dls.locate(None, 1.0)


def test_linen_module_path_is_the_scope():
  nn = pytest.importorskip("flax.linen")

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4, dtype=F16, param_dtype=F16, name="small")(x)
      return nn.Dense(4, dtype=F16, param_dtype=F16, name="big")(x * 1.0e4)

  model = Model()
  x = jnp.ones((2, 4), F16)
  params = model.init(jax.random.key(0), x)

  def loss(params, x):
    return jnp.mean(model.apply(params, x).astype(jnp.float32))

  params = jax.tree.map(lambda p: jnp.full_like(p, 1.0), params)
  first = optax_dls.locate(loss, params, x, scale=1.0).first
  assert (first.phase, first.scope, first.kind) == ("forward", "Model/big", "inf")
  assert first.source == _line(Model.__call__, 'name="big"')


def test_nnx_scope_is_the_nearest_user_function():
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(4, 4, dtype=F16, param_dtype=F16, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.lin(x * 2.0e4)  # 4 * 2e4 > 65504

  graph, state = nnx.split(Net())
  state = jax.tree.map(lambda p: jnp.full_like(p, 1.0), state)

  def loss(state, x):
    return jnp.mean(nnx.merge(graph, state)(x).astype(jnp.float32))

  first = optax_dls.locate(loss, state, jnp.ones((2, 4), F16), scale=1.0).first
  assert (first.phase, first.primitive, first.kind) == ("forward", "dot_general", "inf")
  assert first.scope.endswith("Net.__call__")
  assert first.source == _line(Net.__call__, "self.lin(")


def test_saved_report_is_shown_by_inspect(tmp_path):
  optax = pytest.importorskip("optax")
  from optax_dls import writers
  from optax_dls._logs.report import inspect as inspect_logs

  params = {"w": jnp.ones(2, jnp.float32)}
  state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  report = optax_dls.locate(two_layers, *_two_layer_args(1.0, 64.0), scale=4096.0)
  with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.log(0, optax_dls.metrics(state))
    path = writer.write_locate(report, step=7)
    with pytest.raises(TypeError, match="report"):
      writer.write_locate({"first": None})
  assert json.loads(pathlib.Path(path).read_text())["step"] == 7
  text = inspect_logs(tmp_path)
  assert "the batch of step 7" in text
  assert "first inf: backward dot_general (float16) in second" in text


def test_an_equinox_model_and_non_array_arguments_are_taken():
  """A model holding its activation functions, as the differentiated argument or another
  one, and a string flag among the arguments, as jax.grad would take them around it."""
  eqx = pytest.importorskip("equinox")
  mlp = eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.relu, key=jax.random.key(0))
  mlp = jax.tree.map(lambda x: x.astype(jnp.float16) if eqx.is_inexact_array(x) else x, mlp)

  def loss_fn(m, x, mode):
    assert mode == "eval"
    return jnp.sum(jax.vmap(m)(x).astype(jnp.float32) ** 2)

  x = jnp.full((3, 4), 100.0, jnp.float16)
  report = optax_dls.locate(loss_fn, mlp, x, "eval", scale=2.0**15)
  assert report.first is not None and report.first.kind == "inf"
  quiet = optax_dls.locate(
    lambda x, m: jnp.sum(jax.vmap(m)(x).astype(jnp.float32)), x, mlp, scale=1.0
  )
  assert quiet.first is None


# A float16 constant beyond 65504 is inf already in the jaxpr (a literal, or one of its
# constants): the operation that makes or first reads it is the place, named a constant.


def offset_scalar(w, x):
  with jax.named_scope("offset"):
    h = x @ w + jnp.float16(1e5)
  return jnp.sum(h.astype(jnp.float32))


def offset_full(w, x):
  with jax.named_scope("offset"):
    h = (x @ w) * jnp.full((2, 4), 1e5, F16)
  return jnp.sum(h.astype(jnp.float32))


def offset_asarray(w, x):
  with jax.named_scope("offset"):
    h = (x @ w) * jnp.asarray(1e5, F16)
  return jnp.sum(h.astype(jnp.float32))


def offset_python_float(w, x):
  with jax.named_scope("offset"):
    h = x @ w + 1e5
  return jnp.sum(h.astype(jnp.float32))


def offset_folded_cast(w, x):
  with jax.named_scope("offset"):
    h = x @ w + jnp.float32(1e5).astype(F16)
  return jnp.sum(h.astype(jnp.float32))


def offset_cast(w, x):
  with jax.named_scope("offset"):
    h = x @ w + jnp.full((2, 4), 1e5, jnp.float32).astype(F16)
  return jnp.sum(h.astype(jnp.float32))


def offset_numpy(w, x):
  with jax.named_scope("offset"):
    h = x @ w + np.full((2, 4), 1e5, np.float32).astype(np.float16)
  return jnp.sum(h.astype(jnp.float32))


def offset_earlier_line(w, x):
  big = jnp.float16(1e5)
  with jax.named_scope("offset"):
    h = (x @ w) * big
  return jnp.sum(h.astype(jnp.float32))


@pytest.mark.parametrize(
  ("fun", "text"),
  [
    (offset_scalar, "jnp.float16(1e5)"),
    (offset_full, "jnp.full("),
    (offset_asarray, "jnp.asarray(1e5"),
    (offset_python_float, "+ 1e5"),
    (offset_folded_cast, "jnp.float32(1e5)"),
    (offset_cast, "jnp.full("),
    (offset_numpy, "np.full("),
    (offset_earlier_line, "* big"),
  ],
)
def test_a_float16_literal_beyond_its_range_is_found_as_a_constant(fun, text):
  w, x = jnp.full((4, 4), 0.5, F16), jnp.ones((2, 4), F16)
  # At a scale of 2**15 the backward pass (S * 0.5 * 4 summed) also overflows: the
  # constant, in the forward pass, comes first.
  report = optax_dls.locate(fun, w, x, scale=2.0**15)
  first = report.first
  assert (first.phase, first.scope, first.kind, first.dtype) == (
    "forward",
    "offset",
    "inf",
    "float16",
  )
  assert first.source == _line(fun, text)
  assert "constant" in first.note and "beyond float16's range" in first.note
  assert "already not finite" not in first.note
  assert report.headroom[0].scope == "offset" and report.headroom[0].forward_overflow


def test_a_constant_made_inf_before_the_trace_is_reported_when_nothing_else_is():
  with np.errstate(over="ignore"):
    big = jnp.float16(1e5)  # made, and inf, before locate traces the function

  def loss(w, x):
    with jax.named_scope("offset"):
      h = (x @ w) * big
    return jnp.sum(h.astype(jnp.float32))

  report = optax_dls.locate(loss, jnp.full((4, 4), 0.5, F16), jnp.ones((2, 4), F16), scale=1.0)
  first = report.first
  assert (first.phase, first.primitive, first.scope, first.kind) == (
    "forward",
    "mul",
    "offset",
    "inf",
  )
  assert "constant that is already inf in float16" in first.note
  assert "made before locate traced" in first.note


def test_a_mask_at_the_dtype_s_largest_value_is_no_headroom_used():
  """``jnp.finfo(dtype).min`` as the masked logits (flax's attention writes it so) is a
  sentinel: the scope's headroom is that of its activations."""

  def loss(w, x):
    with jax.named_scope("masked"):
      logits = x @ w
      logits = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), logits, jnp.finfo(F16).min)
      p = jax.nn.softmax(logits.astype(jnp.float32)).astype(F16)
    return jnp.sum((p * 1000.0).astype(jnp.float32))

  report = optax_dls.locate(loss, jnp.full((4, 4), 0.5, F16), jnp.ones((4, 4), F16), scale=1.0)
  assert report.first is None
  (masked,) = [r for r in report.headroom if r.scope == "masked"]
  assert masked.forward_fraction < 0.01  # the logits are 2, the probabilities at most 1


@requires_jax(
  "0.10",
  "older JAX converts a Python -inf to float16 inside jnp.where's own jitted body, from a "
  "constant locate does not see made, and it is reported",
)
def test_an_explicit_inf_is_no_overflow():
  """A deliberate -inf (a mask, as ``jax.nn.softmax(where=...)`` writes it) is no constant
  beyond the range: the layer that does overflow is reported."""

  def loss(w, x):
    with jax.named_scope("masked"):
      p = jax.nn.softmax(x, where=x > 0.5) + jnp.where(x > 0.5, x, -jnp.inf)
    with jax.named_scope("proj"):
      h = jnp.maximum(p, 0.0) @ w
    return jnp.sum(h.astype(jnp.float32))

  x = jnp.array([[1.0, 0.0, 1.0, 0.0]] * 2, F16)
  report = optax_dls.locate(loss, jnp.full((4, 4), 4.0e4, F16), x, scale=1.0)
  assert (report.first.phase, report.first.scope, report.first.note) == ("forward", "proj", "")
  (masked,) = [r for r in report.headroom if r.scope == "masked"]
  assert not masked.forward_overflow


# Repeated blocks: each instance is a scope of its own, named by its path in the model.


def _equinox_model(dtype, big_block, small=0.25, big=2.0e4, bias=None):
  eqx = pytest.importorskip("equinox")

  class ResidualBlock(eqx.Module):
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.linear1 = eqx.nn.Linear(4, 4, key=k1)
      self.linear2 = eqx.nn.Linear(4, 4, key=k2)

    def __call__(self, x):
      h = jax.nn.relu(self.linear1(x))
      return x + self.linear2(h)

  class Model(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
      keys = jax.random.split(key, 4)
      self.blocks = [ResidualBlock(k) for k in keys[:3]]
      self.head = eqx.nn.Linear(4, 1, key=keys[3])

    def __call__(self, x):
      for block in self.blocks:
        x = block(x)
      return self.head(x)

  model = Model(jax.random.key(0))

  def fill(path, a):
    if not eqx.is_array(a):
      return a
    is_bias = getattr(path[-1], "name", None) == "bias"
    return jnp.full_like(a, small if bias is None or not is_bias else bias, dtype)

  model = jax.tree_util.tree_map_with_path(fill, model)
  weight = jnp.full((4, 4), big, dtype)
  model = eqx.tree_at(lambda m: m.blocks[big_block].linear2.weight, model, weight)
  return model, ResidualBlock


def test_repeated_equinox_blocks_are_named_by_their_path():
  model, block_class = _equinox_model(F16, big_block=2)

  def loss(model, x):
    return jnp.sum(jax.vmap(model)(x).astype(jnp.float32))

  report = optax_dls.locate(loss, model, jnp.ones((2, 4), F16), scale=1.0)
  first = report.first
  assert (first.phase, first.primitive, first.scope, first.kind) == (
    "forward",
    "dot_general",
    "blocks/2",
    "inf",
  )
  assert first.source == _line(block_class.__call__, "self.linear2(h)")
  scopes = [row.scope for row in report.headroom]
  assert len(scopes) == len(set(scopes))  # one row per scope
  blocks = [s for s in scopes if s.startswith("blocks/")]
  assert sorted(blocks) == ["blocks/0", "blocks/1", "blocks/2"]  # one row per block instance
  assert scopes[0] == "blocks/2" and report.headroom[0].forward_overflow
  assert not any(r.forward_overflow for r in report.headroom if r.scope in ("blocks/0", "blocks/1"))


def test_block_instances_keep_their_names_through_a_cast_and_in_the_backward_pass():
  """float32 weights cast to float16 inside the loss (a cast policy's ``cast_to_compute``);
  at a large scale the backward pass overflows first in the block with large weights."""
  model, _ = _equinox_model(jnp.float32, big_block=1, small=0.01, big=1000.0, bias=0.0)
  policy = optax_dls.cast_policy("half")

  def loss(model, x):
    return jnp.sum(jax.vmap(policy.cast_to_compute(model))(x).astype(jnp.float32))

  x = jnp.full((2, 4), 1.0e-3, F16)  # the forward pass stays small
  # The cotangent of block 1's hidden layer is about S * 0.01 (the head) * 4 * 1000: inf at
  # 2**12, while the head's weight gradient, S times the output of about 0.16, is not.
  report = optax_dls.locate(loss, model, x, scale=2.0**12)
  first = report.first
  assert (first.phase, first.scope, first.kind) == ("backward", "blocks/1", "inf")
  assert {r.scope for r in report.headroom} >= {"blocks/0", "blocks/1", "blocks/2"}


def block(x, w):
  h = jnp.tanh(x) @ w
  return x + h


def blocks_loss(params, x, block=block):
  for w in params["blocks"]:
    x = block(x, w)
  return jnp.sum(x.astype(jnp.float32))


def test_a_function_called_per_block_is_named_by_the_block_it_is_given():
  params = {"blocks": [jnp.full((4, 4), 0.5, F16) for _ in range(3)]}
  params["blocks"][2] = jnp.full((4, 4), 3.0e4, F16)
  report = optax_dls.locate(blocks_loss, params, jnp.ones((2, 4), F16), scale=1.0)
  first = report.first
  assert (first.phase, first.primitive, first.scope) == ("forward", "dot_general", "blocks/2")
  assert first.source == _line(block, "@ w")
  assert sorted(r.scope for r in report.headroom if r.scope.startswith("blocks/")) == [
    "blocks/0",
    "blocks/1",
    "blocks/2",
  ]
  assert report.headroom[0].scope == "blocks/2"


def test_a_named_scope_inside_a_block_follows_its_path():
  def scoped_block(x, w):
    with jax.named_scope("mix"):
      h = jnp.tanh(x) @ w
    return x + h

  params = {"blocks": [jnp.full((4, 4), 0.5, F16), jnp.full((4, 4), 3.0e4, F16)]}
  loss = functools.partial(blocks_loss, block=scoped_block)
  report = optax_dls.locate(loss, params, jnp.ones((2, 4), F16), scale=1.0)
  assert report.first.scope == "blocks/1/mix"
  assert {"blocks/0/mix", "blocks/0", "blocks/1"} <= {r.scope for r in report.headroom}


def test_a_block_jax_traces_once_is_named_by_its_function():
  """``jax.jit(block)`` called per block runs one trace at each place: the instances are
  not told apart, and no call is named by what the blocks share (``blocks``)."""
  jitted = jax.jit(block)

  def loss(params, x):
    for w in params["blocks"]:
      x = jitted(x, w)
    return jnp.sum((x @ params["head"]).astype(jnp.float32))

  params = {"blocks": [jnp.full((4, 4), 0.5, F16) for _ in range(3)]}
  params["blocks"][2] = jnp.full((4, 4), 3.0e4, F16)
  params["head"] = jnp.ones(4, F16)  # the blocks are not all the model applies
  report = optax_dls.locate(loss, params, jnp.ones((2, 4), F16), scale=1.0)
  assert report.first.scope == "block"


def test_under_another_profiler_calls_are_not_told_apart_and_it_stays():
  def profiler(frame, event, arg):
    return None

  params = {"blocks": [jnp.full((4, 4), 0.5, F16) for _ in range(3)]}
  params["blocks"][2] = jnp.full((4, 4), 3.0e4, F16)
  sys.setprofile(profiler)
  try:
    report = optax_dls.locate(blocks_loss, params, jnp.ones((2, 4), F16), scale=1.0)
    assert sys.getprofile() is profiler
  finally:
    sys.setprofile(None)
  assert report.first.scope == "block"


def test_linen_blocks_made_in_a_loop_keep_their_module_paths():
  nn = pytest.importorskip("flax.linen")

  class ResidualBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(4, dtype=F16, param_dtype=F16)(x))
      return x + nn.Dense(4, dtype=F16, param_dtype=F16)(h)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(3):
        x = ResidualBlock()(x)
      return x

  model, x = Model(), jnp.ones((2, 4), F16)
  params = jax.tree.map(lambda p: jnp.full_like(p, 0.25), model.init(jax.random.key(0), x))
  big = params["params"]["ResidualBlock_2"]["Dense_1"]["kernel"]
  params["params"]["ResidualBlock_2"]["Dense_1"]["kernel"] = jnp.full_like(big, 2.0e4)

  def loss(params, x):
    return jnp.sum(model.apply(params, x).astype(jnp.float32))

  report = optax_dls.locate(loss, params, x, scale=1.0)
  assert (report.first.phase, report.first.scope) == ("forward", "Model/ResidualBlock_2/Dense_1")
  scopes = {r.scope for r in report.headroom}
  assert {f"Model/ResidualBlock_{i}" for i in range(3)} <= scopes
  assert {f"Model/ResidualBlock_{i}/Dense_1" for i in range(3)} <= scopes


def test_nnx_blocks_in_a_list_are_named_by_their_path():
  nnx = pytest.importorskip("flax.nnx")
  if not hasattr(nnx, "List"):
    pytest.skip("nnx.List is flax 0.12's: older flax keeps a module's list otherwise")

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, dtype=F16, param_dtype=F16, rngs=rngs)

    def __call__(self, x):
      return x + self.lin(x)

  class Net(nnx.Module):
    def __init__(self):
      self.blocks = nnx.List([Block(nnx.Rngs(i)) for i in range(3)])

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return x

  graph, state = nnx.split(Net())
  state = jax.tree.map(lambda p: jnp.full_like(p, 0.25), state)
  state["blocks"][1]["lin"]["kernel"][...] = jnp.full((4, 4), 3.0e4, F16)

  def loss(state, x):
    return jnp.sum(nnx.merge(graph, state)(x).astype(jnp.float32))

  report = optax_dls.locate(loss, state, jnp.ones((2, 4), F16), scale=1.0)
  assert (report.first.phase, report.first.scope) == ("forward", "blocks/1")
  assert report.first.source == _line(Block.__call__, "self.lin(x)")
  assert sorted(r.scope for r in report.headroom if r.scope.startswith("blocks/")) == [
    "blocks/0",
    "blocks/1",
    "blocks/2",
  ]
