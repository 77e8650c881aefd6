"""locate: the first operation that made an inf or NaN (phase, scope, source line) and
each scope's headroom, for a linen model, an nnx model and a function with named scopes."""

import inspect
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

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
  from optax_dls import cli, writers

  params = {"w": jnp.ones(2, jnp.float32)}
  state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init(params)
  report = optax_dls.locate(two_layers, *_two_layer_args(1.0, 64.0), scale=4096.0)
  with writers.MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.log(0, optax_dls.metrics(state))
    path = writer.write_locate(report, step=7)
    with pytest.raises(TypeError, match="report"):
      writer.write_locate({"first": None})
  assert json.loads(pathlib.Path(path).read_text())["step"] == 7
  text = cli.inspect(tmp_path)
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
