"""The benchmark scripts run, at a tiny size, and their reference steps compute what they claim."""

import importlib.util
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from _compat import XLA_DEFAULTS

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_step_overhead_runs_every_variant_and_reports_every_ratio(capsys):
  so = _load("step_overhead")
  out = so.main(["--params", "4000", "--steps", "1", "--rounds", "1", "--trees", "big"])
  assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
  rows = out["results"]["big"]
  assert set(so.VARIANTS) <= set(rows) and rows["leaves"] == 8
  for name in so.VARIANTS:
    for ref in ("bare_adam", "floor", "floor_wait", "floor_cond_skip", "floor_where_skip"):
      assert rows[name][f"ratio_to_{ref}"] > 0 and rows[name][f"paired_ratio_to_{ref}"] > 0


def test_the_hand_written_skips_apply_a_finite_step_and_skip_a_non_finite_one():
  """And the floor (waiting for its read or not) applies a finite step as bare Adam does."""
  so = _load("step_overhead")
  params = so.make_tree("big", 800)
  finite = jax.tree.map(lambda p: 1e-3 * p, params)
  bad = dict(finite, p000=finite["p000"].at[0].set(jnp.nan))
  init, bare = so.bare_step()
  want, _ = bare(params, init(params), finite)
  for skip in (None, "wait", "cond", "where"):
    init, step = so.floor_step(skip)
    state = init(params)
    got, _ = step(params, state, finite)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    if skip in ("cond", "where"):
      kept, (opt_state, _, _) = step(params, state, bad)
      jax.tree.map(np.testing.assert_array_equal, kept, params)
      jax.tree.map(np.testing.assert_array_equal, opt_state, state[0])


def _copies(compiled) -> int:
  """Instructions of the compiled program's entry that copy (or transpose) an array."""
  text = compiled.as_text()
  entry = text[text.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  return sum(
    1
    for line in entry.splitlines()
    if re.search(r"= \S+\{[\d,]*\} (copy\(|fusion\(.*calls=%wrapped_(copy|transpose)_)", line)
  )


def test_the_recompute_step_writes_no_more_layout_copies_than_the_plain_step():
  """The retry branch's second backward pass must not change the gradients' layouts on
  the common path: on the CPU its transposed products made every step copy them."""
  e2e = _load("train_step_e2e")
  model = e2e.Transformer(32, 1, 2, 16, e2e.FP16)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 17)), jnp.int32)
  counts = {}
  for recompute in (False, True):
    tx = e2e.VARIANTS["dynamic_loss_scale"]()
    counts[recompute] = _copies(
      e2e.make_step(model, tx, recompute=recompute)
      .lower(params, tx.init(params), batch)
      .compile(compiler_options=XLA_DEFAULTS)
    )
  assert counts[True] <= counts[False], counts
