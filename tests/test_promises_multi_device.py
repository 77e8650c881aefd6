"""docs/multi_device.md: each single-process snippet runs as is on a CPU (8 virtual devices,
a fresh process each: they set the device count before JAX starts) and prints what its
comments say; with ``axis_name="data"`` the ``shard_map`` snippet raises at trace time."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_dls

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "multi_device.md"


def _snippet(title):
  """The ```python block under the ``### <title>`` heading."""
  text = PAGE.read_text()
  section = text.split(f"### {title}", 1)[1]
  return re.search(r"^```python\n(.*?)^```\s*$", section, re.DOTALL | re.MULTILINE).group(1)


def _run(code):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False
  )


def _printed_comments(code):
  """What the snippet's comments say each ``print`` shows: the text after ``# `` up to a
  ``:`` that explains it."""
  said = re.findall(r"^print\(.*\)  # (.*)$", code, re.MULTILINE)
  return [s.split(":")[0] if not s.startswith("P(") else s.split(": ")[0] for s in said]


@pytest.mark.parametrize(
  "title",
  [
    "`jit` with `NamedSharding` (no `axis_name`)",
    "`shard_map` (`axis_name` = every axis the gradients vary over)",
    "`pmap` (`axis_name` = the pmap axis)",
    "`vmap` (an ensemble: one scale per member, or one shared)",
  ],
  ids=["jit", "shard_map", "pmap", "vmap"],
)
def test_each_snippet_runs_as_is_and_prints_what_its_comments_say(title):
  code = _snippet(title)
  proc = _run(code)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  said = _printed_comments(code)
  assert len(lines) == len(said) >= 1, (lines, said)
  for line, expected in zip(lines, said):
    line = line.replace("PartitionSpec(", "P(")  # jax before 0.8 prints the long name
    assert line.split() == expected.split(), (line, expected)


def test_the_shard_map_snippet_with_axis_name_data_raises_at_trace_time():
  code = _snippet("`shard_map` (`axis_name` = every axis the gradients vary over)")
  code = code.replace('axis_name=("data", "model")', 'axis_name="data"')
  proc = _run(code)
  assert proc.returncode != 0
  message = "ValueError: axis_name='data' does not cover the mapped axes ['model'] over which the"
  assert message in proc.stderr


def _shard_map_norm(check_vma):
  """The stored grad_norm of one update of gradients sharded over 8 devices."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0, axis_name="data")
  params = {"w": jnp.ones(16)}
  state = tx.init(params)

  def update(grads, state, params):
    _, state = tx.update(grads, state, params)
    return state.grad_norm

  step = jax.jit(
    jax.shard_map(
      update,
      mesh=mesh,
      in_specs=(P("data"), P(), P("data")),
      out_specs=P(),
      check_vma=check_vma,
    )
  )
  grads = {"w": jnp.arange(16.0)}
  return float(step(grads, state, params)), float(jnp.linalg.norm(grads["w"]))


def test_the_stored_norm_is_global_with_check_vma_and_global_over_sqrt_n_without():
  """'the norm of the full gradient' with check_vma=True; 'the global norm divided by
  sqrt(number of devices)' for sharded gradients with check_vma=False."""
  norm, full = _shard_map_norm(check_vma=True)
  np.testing.assert_allclose(norm, full, rtol=1e-6)
  norm, full = _shard_map_norm(check_vma=False)
  np.testing.assert_allclose(norm, full / np.sqrt(8), rtol=1e-6)


def test_with_the_vmap_axis_name_the_norm_is_the_root_mean_square_of_the_members_norms():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0, axis_name="ens")
  params = {"w": jnp.ones((3, 2))}
  grads = {"w": jnp.array([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]])}  # norms 5, 1, 10
  _, state = jax.jit(jax.vmap(tx.update, axis_name="ens"))(grads, jax.vmap(tx.init)(params), params)
  np.testing.assert_allclose(state.grad_norm, np.full(3, np.sqrt((25 + 1 + 100) / 3)), rtol=1e-6)


@pytest.mark.parametrize("axis_name", ["i", ("i", "j")])
def test_axis_name_is_taken_by_every_constructor_and_by_all_finite_and_underflow_stats(axis_name):
  """ "`axis_name` takes one name or a tuple of names, on `dynamic_loss_scale`,
  `static_loss_scale`, `no_loss_scale` and `loss_scaled` alike (and on `all_finite` and
  `underflow_stats`)": under vmap over those axes, one decision for every member (the
  no-op `no_loss_scale` checks nothing)."""
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  shape = (4,) if len(names) == 1 else (2, 2)

  def mapped(f):
    for name in reversed(names):
      f = jax.vmap(f, axis_name=name)
    return f

  inner = optax.sgd(1.0)
  stats = optax_dls.underflow_stats(axis_name=axis_name)
  deciding = [
    optax_dls.dynamic_loss_scale(inner, axis_name=axis_name),
    optax_dls.static_loss_scale(inner, 2.0, axis_name=axis_name),
    optax_dls.loss_scaled(inner, optax_dls.dynamic_policy(), axis_name=axis_name),
    optax_dls.dynamic_loss_scale(optax.chain(stats, inner), axis_name=axis_name),
  ]
  params = {"w": jnp.ones((*shape, 3))}
  grads = {"w": jnp.ones((*shape, 3)).at[(0,) * len(shape) + (0,)].set(jnp.inf)}  # one member
  for tx in [*deciding, optax_dls.no_loss_scale(inner, axis_name=axis_name)]:
    _, state = jax.jit(mapped(tx.update))(grads, mapped(tx.init)(params), params)
    assert bool(jnp.all(~state.last_step_finite)) == (tx in deciding)
  assert not bool(jnp.any(mapped(lambda g: optax_dls.all_finite(g, axis_name=axis_name))(grads)))
