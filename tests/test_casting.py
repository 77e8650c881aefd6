"""CastPolicy, cast_policy and full_precision: jmp's casting, with jmp as the oracle."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_dls
from optax_dls._features.casting import CastPolicy

jmp = pytest.importorskip("jmp")

NAMES = ["bf16", "bfloat16", "f16", "float16", "full", "f32", "float32", "f64", "float64", "half"]
KEYS = {"param": ["p", "params"], "compute": ["c", "compute"], "output": ["o", "output"]}


def _jmp_strings():
  """Every string form jmp reads: one name; and every subset of the keys, in every
  order, with each spelling of each key, over a rotation of the dtype names."""
  yield from NAMES
  for r in (1, 2, 3):
    for roles in itertools.permutations(KEYS, r):
      for spellings in itertools.product(*(KEYS[role] for role in roles)):
        for shift in range(len(NAMES)):
          values = [NAMES[(shift + 3 * i) % len(NAMES)] for i in range(r)]
          yield ",".join(f"{k}={v}" for k, v in zip(spellings, values))
  yield "p=f16,p=bf16"  # a key given twice: the last wins, in jmp as here
  yield "c=f16,c=f32,o=bf16"


def _same(ours, theirs):
  return (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
    jnp.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
  )


def test_cast_policy_reads_every_string_form_as_jmp_does():
  strings = list(_jmp_strings())
  assert len(strings) > 700
  for s in strings:
    ours, theirs = optax_dls.cast_policy(s), jmp.get_policy(s)
    assert _same(ours, theirs), s
    assert str(ours) == str(theirs), s
    assert optax_dls.cast_policy(str(ours)) == ours, s  # str round-trips


BAD = ["", "f", "float", "half16", "F16", "fp16", "p=f16,", "p=f16=f32", "x=f16", "=f16"]
BAD += ["p=int32", "p = f16", "p=f16, c=f16", "p=f16,c", ",", "params=float32;compute=float16"]


@pytest.mark.parametrize("bad", BAD)
def test_cast_policy_rejects_what_jmp_rejects_naming_the_string_and_the_forms(bad):
  with pytest.raises(ValueError):
    jmp.get_policy(bad)
  with pytest.raises(ValueError, match="params/p, compute/c, output/o") as e:
    optax_dls.cast_policy(bad)
  assert repr(bad) in str(e.value)


def test_cast_policy_rejects_a_non_string():
  with pytest.raises(TypeError, match="policy_name must be a string"):
    optax_dls.cast_policy(jnp.float16)


def _tree():
  return {
    "w": jnp.ones(2, jnp.float32),
    "h": jnp.ones(2, jnp.bfloat16),
    "n": np.ones(2, np.float32),
    "step": jnp.array(3, jnp.int32),
    "mask": jnp.array([True, False]),
    "z": jnp.ones(2, jnp.complex64),
    "act": jax.nn.relu,
    "none": None,
    "name": "layer",
    "scalar": 0.5,
    "np_scalar": np.float32(0.5),
  }


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_casts_only_the_floating_arrays_as_jmp_does(method):
  ours = getattr(CastPolicy(jnp.float16, jnp.bfloat16, jnp.float32), method)
  theirs = getattr(jmp.Policy(jnp.float16, jnp.bfloat16, jnp.float32), method)
  out, want = ours(_tree()), theirs(_tree())
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
    assert type(a) is type(b)
    if hasattr(b, "dtype"):
      assert a.dtype == b.dtype
    else:
      assert a is b or a == b
  target = {"cast_to_param": "float16", "cast_to_compute": "bfloat16"}.get(method, "float32")
  assert out["w"].dtype == out["h"].dtype == out["n"].dtype == target
  assert isinstance(out["n"], np.ndarray)
  assert (out["act"], out["name"], out["none"], out["scalar"]) == (jax.nn.relu, "layer", None, 0.5)
  kept = [str(out[k].dtype) for k in ("step", "mask", "z", "np_scalar")]
  assert kept == ["int32", "bool", "complex64", "float32"]  # a NumPy scalar is not an array


def test_cast_policy_defaults_follow_jmp_and_check_their_arguments():
  p = CastPolicy(compute_dtype=jnp.float16)
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == ("float32", "float16", "float16")
  assert p.with_output_dtype(jnp.float32).output_dtype == "float32"
  assert p == optax_dls.cast_policy("c=f16") and hash(p) == hash(optax_dls.cast_policy("c=f16"))
  with pytest.raises(
    ValueError, match="compute_dtype must be a floating dtype, got compute_dtype=int32"
  ):
    CastPolicy(jnp.float32, jnp.int32)
  with pytest.raises(TypeError, match="output_dtype must be a dtype"):
    CastPolicy(jnp.float32, jnp.float16, "not a dtype")


def test_cast_policy_is_a_static_argument_of_jit():
  @jax.jit
  def f(x, policy):
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  f = jax.jit(f.__wrapped__, static_argnums=1)
  out = f(jnp.ones(2), optax_dls.cast_policy("p=f32,c=f16,o=bf16"))
  assert out.dtype == jnp.bfloat16


def _rms(x):
  return jnp.sqrt(jnp.mean(x * x))


def test_full_precision_keeps_a_float16_overflow_out():
  x = jnp.full(4, 300.0, jnp.float16)  # x * x = 90000 > float16's 65504
  assert not jnp.isfinite(_rms(x))
  out = optax_dls.full_precision(_rms)(x)
  assert out.dtype == jnp.float16 and float(out) == 300.0


def test_full_precision_under_grad_and_jit():
  x = jnp.linspace(100.0, 400.0, 4, dtype=jnp.float16)
  loss = jax.jit(jax.value_and_grad(optax_dls.full_precision(_rms)))
  value, grad = loss(x)
  ref_value, ref_grad = jax.value_and_grad(_rms)(x.astype(jnp.float32))
  assert value.dtype == grad.dtype == jnp.float16  # a float16 argument gets a float16 gradient
  np.testing.assert_allclose(value, ref_value, rtol=1e-3)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-3)
  without = np.asarray(jax.grad(_rms)(x), np.float32)  # float16 throughout: x * x overflows
  assert not np.allclose(without, ref_grad, rtol=0.1)


def test_full_precision_output_dtypes_and_untouched_arguments():
  seen = {}

  def fn(x, n, act, scale=1.0):
    seen.update(x=x.dtype, n=n.dtype, scale=type(scale))
    return {"y": act(x) * scale, "n": n}

  h, n = jnp.ones(2, jnp.float16), jnp.arange(2)
  out = optax_dls.full_precision(fn)(h, n, jax.nn.relu, scale=2.0)
  assert seen == {"x": jnp.float32, "n": jnp.int32, "scale": float}
  assert out["y"].dtype == jnp.float16 and out["n"].dtype == jnp.int32
  mixed = optax_dls.full_precision(lambda a, b: a + b)(h, jnp.ones(2, jnp.float32))
  assert mixed.dtype == jnp.float32  # the arguments' promoted dtype
  kept = optax_dls.full_precision(output_dtype=jnp.float32)(_rms)(h)
  assert kept.dtype == jnp.float32
  assert optax_dls.full_precision(lambda: jnp.ones(1, jnp.float32))().dtype == jnp.float32
  assert optax_dls.full_precision(_rms).__name__ == "_rms"


def test_full_precision_checks_its_arguments():
  with pytest.raises(TypeError, match="fn must be callable"):
    optax_dls.full_precision(3)
  with pytest.raises(ValueError, match="output_dtype must be a floating dtype"):
    optax_dls.full_precision(_rms, output_dtype=jnp.int32)


def test_the_migration_guide_forms_of_jmp_module_functions():
  """docs/guide/migrate_jmp.md: cast_to_full, cast_to_half and half_dtype, through policies."""
  tree = _tree()
  for ours, theirs in [
    (optax_dls.cast_policy("full").cast_to_compute(tree), jmp.cast_to_full(tree)),
    (optax_dls.cast_policy("half").cast_to_compute(tree), jmp.cast_to_half(tree)),
  ]:
    dtypes = lambda t: [getattr(x, "dtype", x) for x in jax.tree_util.tree_leaves(t)]
    assert dtypes(ours) == dtypes(theirs)
  assert optax_dls.cast_policy("half").compute_dtype == jnp.dtype(jmp.half_dtype())
  p = optax_dls.cast_policy("p=f32,c=f16,o=f16").with_output_dtype(jnp.float32)
  assert str(p) == str(jmp.get_policy("p=f32,c=f16,o=f16").with_output_dtype(jnp.float32))


def test_dtype_arguments_take_jmp_names_and_refuse_what_jax_cannot_hold():
  """'f16' is float16 here, as in jmp's strings (NumPy alone reads it as float128)."""
  policy = CastPolicy("f16", output_dtype="full")
  assert (policy.param_dtype, policy.output_dtype) == (jnp.float16, jnp.float32)
  assert optax_dls.cast_policy("c=f16").with_output_dtype("f16").output_dtype == jnp.float16
  assert optax_dls.full_precision(lambda x: x, output_dtype="f16")(jnp.ones(2)).dtype == jnp.float16
  with pytest.raises(ValueError, match="param_dtype must be a floating dtype JAX computes in"):
    CastPolicy("float128")
  with pytest.raises(TypeError, match="param_dtype must be a dtype"):
    CastPolicy(None)
