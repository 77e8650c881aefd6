"""Axis names, variance over mesh axes, and the axis-coverage check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from optax_dls._core import multi_device as _multi_device

MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


@pytest.mark.parametrize(
  "name, expected", [(None, ()), ("d", ("d",)), (["a", "b"], ("a", "b")), (("a",), ("a",))]
)
def test_axis_names(name, expected):
  assert _multi_device.axis_names(_multi_device.check_axis_name(name)) == expected


@pytest.mark.parametrize("bad", [5, (), ("a", 3), [None]])
def test_bad_axis_name_is_a_type_error_naming_it(bad):
  with pytest.raises(TypeError, match="axis_name"):
    _multi_device.check_axis_name(bad)


DATA_MODEL = P("data", "model")


def _in_shard_map(fn, spec=DATA_MODEL):
  out = {}

  def local(x):
    out.update(fn(x))
    return x

  jax.jit(jax.shard_map(local, mesh=MESH, in_specs=spec, out_specs=spec))(jnp.ones((4, 2)))
  return out


def test_varying_axes_vary_like_and_replicas():
  def probe(x):
    zero = jnp.zeros([])
    return {
      "x": _multi_device.varying_axes(x),
      "zero": _multi_device.varying_axes(zero),
      "zero_like_x": _multi_device.varying_axes(_multi_device.vary_like(zero, x)),
      "copies": _multi_device.replicas(zero, {"data": 4, "model": 2}),
      "x_copies": _multi_device.replicas(x, {"data": 4, "model": 2}),
    }

  got = _in_shard_map(probe)
  assert (
    got["x"] == {"data", "model"}
    and got["zero"] == frozenset()
    and got["zero_like_x"] == {"data", "model"}
  )
  assert got["copies"] == 8 and got["x_copies"] == 1
  assert _multi_device.varying_axes(jnp.ones(3)) == frozenset()  # outside shard_map


def test_coverage_check_names_the_missing_axis():
  def probe(x):
    _multi_device.check_axis_coverage([x], jnp.zeros([]), ("data", "model"))  # covered: no error
    with pytest.raises(ValueError, match=r"\['model'\].*axis_name=\('data', 'model'\)"):
      _multi_device.check_axis_coverage([x], jnp.zeros([]), "data")
    return {}

  _in_shard_map(probe)


def test_a_misspelt_axis_name_is_named_and_left_out_of_the_advice():
  """A typo ('modle') is not advised back: the advice names only mapped axes, and the
  message says which given name is not mapped, with the likely one."""

  def probe(x):
    with pytest.raises(ValueError) as info:
      _multi_device.check_axis_coverage([x], jnp.zeros([]), ("data", "modle"))
    message = str(info.value)
    assert "'modle' is not a mapped axis here (did you mean 'model'?)" in message
    assert "the mapped axes here are ['data', 'model']" in message
    assert "Pass axis_name=('data', 'model') to" in message
    assert "modle" not in message.split("Pass axis_name=")[1]
    with pytest.raises(ValueError, match=r"Pass axis_name='model' to"):
      _multi_device.check_axis_coverage([x], jnp.zeros([]), "modle")
    return {}

  _in_shard_map(probe, spec=P(None, "model"))


def test_an_axis_that_is_not_mapped_is_a_clear_error():
  with pytest.raises(ValueError, match=r"'data' is not a mapped axis \(no axis is mapped here\)"):
    jax.jit(lambda x: _multi_device.axis_sizes("data"))(1.0)


def test_a_misspelt_axis_name_among_mapped_ones_is_named_with_the_mapped_axes():
  """('data', 'modle') under shard_map: the message names 'modle' as not mapped and lists
  the mapped axes, rather than advising the typo back."""

  def probe(x):
    with pytest.raises(ValueError) as info:
      _multi_device.axis_sizes(("data", "modle"))
    message = str(info.value)
    assert (
      "'modle' is not a mapped axis (the mapped axes here are ['data', 'model']; did you mean "
      "'model'?)" in message
    )
    assert "'data' is not" not in message
    return {}

  _in_shard_map(probe)


def test_psum_and_pmax_are_identities_without_names():
  x = jnp.arange(3.0)
  assert _multi_device.psum(x, None) is x and _multi_device.pmax(x, None) is x
