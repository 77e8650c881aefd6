"""The one-read finite check stays exact at its edges: huge finite values, scales below 1."""

import ast
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compat import apply_step
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_dls
from optax_dls._core import numerics as _numerics


def _step(tx, grads):
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  return updates, state


def test_huge_finite_gradients_are_finite_and_applied(lowering):
  grads = {"w": jnp.array([1e30, -3e38], jnp.float32), "h": jnp.array([65504.0], jnp.float16)}
  updates, state = _step(
    optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0, skip_lowering=lowering), grads
  )
  assert bool(state.last_step_finite)
  np.testing.assert_array_equal(np.asarray(updates["w"]), -np.asarray(grads["w"]))
  # The squares overflow float32; the norm is still right (taken relative to the largest entry).
  expected = np.linalg.norm(np.concatenate([np.asarray(g, np.float64) for g in grads.values()]))
  np.testing.assert_allclose(float(state.grad_norm), expected, rtol=1e-6)


@pytest.mark.parametrize("with_params", [True, False])
def test_finite_float16_gradients_whose_squares_pass_float16_s_range_are_applied(
  with_params, lowering
):
  """A float16 leaf whose sum of squares is past 65504 (a norm above 256) is finite: the
  CPU's quick path must not read the sum as the leaf's largest entry."""
  params = {"w": jnp.zeros(16, jnp.float16)}
  grads = {"w": jnp.full(16, 100.0, jnp.float16)}
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0, skip_lowering=lowering)
  updates, state = tx.update(grads, tx.init(params), params if with_params else None)
  assert bool(state.last_step_finite) and float(state.loss_scale) == 1024.0
  np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -100.0 / 1024.0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_past_the_float32_range_is_inf_but_the_step_is_finite(dtype, lowering):
  grads = {"w": jnp.array([3e38, 3e38], dtype)}
  updates, state = _step(
    optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0, skip_lowering=lowering), grads
  )
  assert bool(state.last_step_finite) and float(state.grad_norm) == np.inf
  np.testing.assert_array_equal(np.asarray(updates["w"]), -np.asarray(grads["w"]))


@pytest.mark.parametrize(
  "make",
  [
    lambda **kw: optax_dls.static_loss_scale(optax.sgd(1.0), 0.5, **kw),
    lambda **kw: optax_dls.loss_scaled(
      optax.sgd(1.0), optax_dls.dynamic_policy(0.5, min_scale=2.0**-126), **kw
    ),
  ],
  ids=["static", "dynamic_below_one"],
)
@pytest.mark.parametrize("value, finite", [(30000.0, True), (40000.0, False)])
def test_scale_below_one_unscaling_overflow_is_caught(make, value, finite, lowering):
  # u = g / 0.5: 60000 fits float16, 80000 overflows it to inf, where u stays float16 (a
  # float16 parameter); a float32 parameter gets u in float32, where 80000 is finite.
  tx = make(skip_lowering=lowering)
  grads = {"h": jnp.array([value], jnp.float16)}
  for param_dtype, applied in ((jnp.float16, finite), (jnp.float32, True)):
    params = {"h": jnp.zeros(1, param_dtype)}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert bool(state.last_step_finite) is applied, param_dtype
    expected = -2.0 * value if applied else 0.0
    np.testing.assert_array_equal(np.asarray(updates["h"], np.float32), np.float32(expected))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_one_bad_entry_among_huge_ones_is_caught(bad, dtype, lowering):
  big = float(jnp.finfo(dtype).max)
  grads = {"a": jnp.full((5,), big, dtype), "b": jnp.array([1.0, bad], dtype)}
  _, state = _step(
    optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=1.0, skip_lowering=lowering), grads
  )
  assert not bool(state.last_step_finite)


# One transformation for every example, so jit reuses its compilation per dtype; the scale is state.
_BOUNDARY_TX = {
  k: optax_dls.dynamic_loss_scale(
    optax.sgd(1.0), init_scale=0.5, min_scale=2.0**-126, max_scale=1.0, skip_lowering=k
  )
  for k in ("cond", "where")
}


@settings(max_examples=60, deadline=None)
@given(
  dtype=st.sampled_from(["float16", "bfloat16", "float32", "complex64"]),
  scale=st.floats(2.0**-20, 0.75, width=32),
  spread=st.lists(st.floats(0.5, 1.5, width=32), min_size=1, max_size=6),
)
def test_scale_below_one_flag_matches_elementwise_unscale(dtype, scale, spread):
  # Entries straddle the value that unscaling carries to the dtype's largest finite
  # number, so the flag is decided by rounding at the very edge of the range.
  edge = float(jnp.finfo(jnp.real(jnp.zeros([], dtype)).dtype).max) * scale
  values = np.minimum(np.asarray(spread, np.float64) * edge, np.finfo(np.float32).max)
  grads = {"g": jnp.asarray(values.astype(np.float32)).astype(dtype)}
  if dtype == "complex64":
    grads = {"g": jnp.asarray(values[::-1].astype(np.float32)).astype(dtype) * 1j + 0.5}
  params = jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads)
  inv = (1.0 / jnp.float32(scale)).astype(jnp.float32)
  expected = bool(jnp.all(jnp.isfinite(_numerics.unscale(grads, inv)["g"])))
  for tx in _BOUNDARY_TX.values():  # each lowering
    state = optax_dls.reset_scale(tx.init(params), scale)
    _, state = jax.jit(tx.update)(grads, state, params)
    assert bool(state.last_step_finite) is expected


def test_scale_set_below_one_by_reset_scale_is_still_checked_exactly(lowering):
  # A scale below 1 (here set by reset_scale): 40000 / 0.5 overflows float16, so the step
  # must be skipped.
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), min_scale=2.0**-4, skip_lowering=lowering)
  params = {"w": jnp.zeros(2, jnp.float16)}
  state = optax_dls.reset_scale(tx.init(params), 0.5)
  new, state = jax.jit(lambda g, s, p: apply_step(tx, g, s, p))(
    {"w": jnp.array([40000.0, 1.0], jnp.float16)}, state, params
  )
  assert not bool(state.last_step_finite)
  np.testing.assert_array_equal(np.asarray(new["w"]), np.zeros(2, np.float16))


@pytest.mark.parametrize(
  "grads, scale",
  [
    ({"w": jnp.array([3e38, 3e38], jnp.float32)}, 4.0),  # scaled norm overflows, unscaled fits
    ({"z": jnp.array([3e38 + 3e38j], jnp.complex64)}, 2.0**15),  # |z| overflows, parts finite
    ({"w": jnp.array([3e38], jnp.float32), "h": jnp.array([60000.0, 1.0], jnp.float16)}, 2.0**10),
  ],
  ids=["float32", "complex64", "mixed"],
)
def test_norm_of_huge_scaled_gradients_is_the_unscaled_norm(grads, scale, lowering):
  tx = optax_dls.static_loss_scale(optax.sgd(1.0), scale, skip_lowering=lowering)
  _, state = _step(tx, grads)
  assert bool(state.last_step_finite)
  flat = np.concatenate([np.abs(np.asarray(g, np.complex128)).ravel() for g in grads.values()])
  np.testing.assert_allclose(float(state.grad_norm), np.linalg.norm(flat) / scale, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float8_e5m2, jnp.float8_e4m3fn])
def test_all_finite_on_float8(dtype):
  assert bool(optax_dls.all_finite({"a": jnp.array([1.0, -2.0], dtype)}))
  assert not bool(optax_dls.all_finite({"a": jnp.array([1.0, jnp.nan], dtype)}))


def _cast(values, dtype):
  with np.errstate(over="ignore"):  # beyond float16's range a value becomes inf: intended
    return np.asarray(values, np.float32).astype(dtype)


_LEAF = st.sampled_from(["float16", "bfloat16", "float32", "complex64"]).flatmap(
  lambda d: st.lists(
    st.sampled_from([0.0, 1e-8, -3.0, 6e4, 1e19, 3e38, np.inf, -np.inf, np.nan]),
    min_size=1,
    max_size=5,
  ).map(lambda v, d=d: _cast(v, d))
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
  leaves=st.lists(_LEAF, min_size=1, max_size=3),
  scale=st.sampled_from([2.0**-20, 0.5, 1.0, 3.0, 2.0**15, 2.0**100, 0.0, -1.0, np.inf, np.nan]),
)
def test_the_check_agrees_with_numpy_on_the_flag_the_codes_and_the_norm(leaves, scale):
  grads = {f"g{i}": jnp.asarray(x) for i, x in enumerate(leaves)}
  check = jax.jit(_numerics.check)(grads, jnp.float32(scale))
  valid = 0 < scale < np.inf
  k = max(1.0 / scale, 1.0) if valid else 1.0
  codes = []
  with np.errstate(over="ignore", invalid="ignore"):
    for x in leaves:
      wide = np.asarray(x, np.complex128)
      top = np.max(np.maximum(np.abs(wide.real), np.abs(wide.imag)))
      real = np.real(x).dtype
      codes.append(2 if np.isnan(top) else int(not np.isfinite(np.asarray(top * k).astype(real))))
    flat = np.concatenate([np.abs(np.asarray(x, np.complex128)).ravel() for x in leaves])
    expected = np.float32(np.linalg.norm(flat) / scale) if valid else np.nan
  np.testing.assert_array_equal(check.codes, codes)
  assert bool(check.finite) == (valid and not any(codes))
  if bool(check.finite):  # a finite step: the unscaled norm (inf past float32)
    np.testing.assert_allclose(float(check.grad_norm), expected, rtol=1e-5)


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_half_gradient_of_a_float32_parameter_is_unscaled_into_float32(half, lowering):
  # 2**-30 is below float16's smallest subnormal (2**-24): scaled by 2**15 it is 2**-15,
  # unscaled back into float16 it would be 0.
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**15, skip_lowering=lowering)
  grads = {"w": jnp.full([3], 2.0**-15, half)}
  updates, state = _step(tx, grads)
  assert bool(state.last_step_finite)
  assert updates["w"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.full([3], -(2.0**-30), np.float32))


def test_unscale_keeps_the_gradient_dtype_for_half_parameters_or_no_parameters(lowering):
  # Documented choice: where the parameter is as narrow as its gradient, or update gets no
  # parameters, the unscaled gradient keeps its own dtype (values below its smallest
  # subnormal are flushed, as they would be in the parameter itself).
  tx = optax_dls.dynamic_loss_scale(optax.sgd(1.0), init_scale=2.0**15, skip_lowering=lowering)
  grads = {"w": jnp.full([2], 2.0**-15, jnp.float16)}
  params = {"w": jnp.zeros([2], jnp.float16)}
  state = tx.init(params)
  for p in (params, None):
    updates, _ = jax.jit(tx.update)(grads, state, p)
    assert updates["w"].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), [0.0, 0.0])


def test_unscale_into_the_parameter_dtype_skips_none_and_mismatched_trees():
  inv = jnp.float32(2.0**-15)
  grads = {"a": jnp.full([1], 2.0**-15, jnp.float16), "f": None}
  params = {"a": jnp.zeros([1], jnp.float32), "f": jnp.tanh}
  out = _numerics.unscale(grads, inv, params)
  assert out["a"].dtype == jnp.float32 and out["f"] is None
  assert _numerics.unscale(grads, inv, {"other": 1.0})["a"].dtype == jnp.float16


def _imported_modules(source: str) -> set[str]:
  """Every module and name an ``import`` / ``from ... import`` of ``source`` names."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      names |= {node.module or ""} | {a.name for a in node.names}
  return names


def test_the_finite_check_does_not_know_the_records_layout():
  # The check returns plain per-leaf flags; the non-finite record packs them into its words.
  source = inspect.getsource(inspect.getmodule(optax_dls.all_finite))
  names = _imported_modules(source)
  assert not any("_localisation" in n or n.endswith("record") for n in names), names
