"""Cost of one optimizer step with loss scaling, as a ratio to a bare ``optax.adam`` step.

Same run, same pytrees, same inner ``optax.adam``, donated parameters and optimizer
state. Each skip lowering ("auto", the platform's default; "cond"; "where") through
``tx.update`` then ``optax.apply_updates`` (what most users and flax's ``TrainState``
call); and ``no_loss_scale``.
Every row has its compile seconds (``compile_s``, lowering and compiling, one process
for all rows). References: the bare step; the floor, the bare step on gradients times a
run-time ``1/S`` plus one extra read of the gradients (the unscale and the finite check
that every loss scaler needs); ``floor_wait``, the floor whose update waits for that
read, as any skip's must; and the floor with a skip written by hand as a plain
``lax.cond`` or ``jnp.where`` (``floor_cond_skip``, ``floor_where_skip``: see
:func:`floor_step`). Every row has its ratio to each reference, as the ratio of the
medians over all steps (``ratio_to_*``) and as the median over rounds of the ratio of
the rounds' medians (``paired_ratio_to_*``: each round times every variant back to back,
so this one discounts drift in the machine's load). Prints one JSON object. Usage::

    python benchmarks/step_overhead.py [--steps 60] [--rounds 20] [--trees big,many]
        [--params 8000000] [--variants bare_adam,floor_wait,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_dls


def make_tree(kind: str, total: int) -> dict:
  rng = np.random.default_rng(0)
  if kind == "big":  # 8 equal leaves
    sizes = [total // 8] * 8
  else:  # 200 leaves of mixed sizes summing to about `total`
    raw = rng.lognormal(0.0, 1.5, 200)
    sizes = np.maximum(1, (raw / raw.sum() * total).astype(int)).tolist()
  return {
    f"p{i:03d}": jnp.asarray(rng.standard_normal(n, dtype=np.float32)) for i, n in enumerate(sizes)
  }


def inner():
  return optax.adam(1e-3)


def bare_step():
  tx = inner()

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def bare_unscaled_step():
  """The bare step on gradients multiplied by a run-time ``1 / loss_scale``: the
  unscale every loss scaler needs, with no check and no skip."""
  tx = inner()

  def init(params):
    return tx.init(params), jnp.float32(1.0)

  def step(params, state, grads):
    opt_state, scale = state
    inv = 1.0 / scale
    updates, opt_state = tx.update(jax.tree.map(lambda g: g * inv, grads), opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, scale)

  return init, step


def floor_step(skip=None):
  """The bare step on unscaled gradients plus one extra read of them (their sum of
  squares, kept in the state so that it is computed): the least any loss scaler does.

  ``skip="wait"`` multiplies the gradients by ``1/S`` only where the read is finite
  (0 otherwise): the same work, but the update now waits for the read, as the
  update of any skip must wait for the all-finite flag. ``skip`` adds a skip written
  by hand: ``"cond"`` runs the update
  in a plain ``lax.cond`` (zeros and the old state otherwise); ``"where"`` runs it
  always and keeps the old state with ``jnp.where`` (flax's and jmp's selection,
  here of the updates and the inner state only)."""
  tx = inner()

  def init(params):
    return tx.init(params), jnp.float32(1.0), jnp.float32(0.0)

  def step(params, state, grads):
    opt_state, scale, _ = state
    read = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
    finite, inv = jnp.isfinite(read), 1.0 / scale
    if skip == "wait":
      inv = jnp.where(finite, inv, 0.0)
    unscaled = jax.tree.map(lambda g: g * inv, grads)
    if skip == "cond":
      updates, opt_state = jax.lax.cond(
        finite,
        lambda g, s: tx.update(g, s, params),
        lambda g, s: (jax.tree.map(jnp.zeros_like, g), s),
        unscaled,
        opt_state,
      )
    elif skip == "where":
      safe = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), unscaled)
      updates, new_state = tx.update(safe, opt_state, params)
      updates = jax.tree.map(lambda u: jnp.where(finite, u, 0.0), updates)
      opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, opt_state)
    else:
      updates, opt_state = tx.update(unscaled, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, scale, read)

  return init, step


def ours_step(lowering):
  if lowering == "no_loss_scale":  # the passthrough wrapper, for bfloat16 / float32 runs
    tx = optax_dls.no_loss_scale(inner())
  else:
    tx = optax_dls.dynamic_loss_scale(
      inner(), init_scale=1.0, min_scale=1.0, skip_lowering=lowering
    )

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def jmp_step():
  import jmp

  tx = inner()

  def init(params):  # jmp's scale as plain arrays: its pytree does not survive jit's lowering
    return tx.init(params), (jnp.float32(1.0), jnp.int32(0))

  def step(params, state, grads):
    opt_state, (scale, counter) = state
    ls = jmp.DynamicLossScale(scale, counter)
    grads = ls.unscale(grads)
    finite = jmp.all_finite(grads)
    ls = ls.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp.select_tree(finite, new_params, params)
    opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
    return params, (opt_state, (ls.loss_scale, ls.counter))

  return init, step


def flax_step():
  """flax ``DynamicScale``'s documented pattern: ``jnp.where`` over params and opt state."""
  tx = inner()

  def init(params):
    return tx.init(params), jnp.float32(1.0)

  def step(params, state, grads):
    opt_state, scale = state
    grads = jax.tree.map(lambda g: g / scale, grads)
    is_fin = jnp.array(True)
    for g in jax.tree.leaves(grads):
      is_fin &= jnp.all(jnp.isfinite(g))
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    sel = lambda new, old: jnp.where(is_fin, new, old)
    params = jax.tree.map(sel, new_params, params)
    opt_state = jax.tree.map(sel, new_opt_state, opt_state)
    scale = jnp.where(is_fin, scale, scale / 2)
    return params, (opt_state, scale)

  return init, step


def apply_if_finite_step():
  tx = optax.apply_if_finite(inner(), max_consecutive_errors=10**9)

  def init(params):
    return tx.init(params), jnp.float32(1.0)

  def step(params, state, grads):
    opt_state, scale = state
    grads = jax.tree.map(lambda g: g * (1.0 / scale), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, scale)

  return init, step


VARIANTS = {  # name -> (factory, non-finite gradients?)
  "bare_adam": (bare_step, False),
  "bare_adam_unscaled": (bare_unscaled_step, False),
  "floor": (floor_step, False),
  "floor_wait": (functools.partial(floor_step, "wait"), False),
  "floor_cond_skip": (functools.partial(floor_step, "cond"), False),
  "floor_where_skip": (functools.partial(floor_step, "where"), False),
  **{
    f"{lowering}_update_{kind}": (functools.partial(ours_step, lowering), kind == "nonfinite")
    for lowering in ("auto", "cond", "where")
    for kind in ("finite", "nonfinite")
  },
  "no_loss_scale_update": (functools.partial(ours_step, "no_loss_scale"), False),
  "jmp_pattern": (jmp_step, False),
  "flax_where_pattern": (flax_step, False),
  "apply_if_finite_pattern": (apply_if_finite_step, False),
}
PATTERNS = ("jmp_pattern", "flax_where_pattern", "apply_if_finite_pattern")


def prepare(factory, params, grads) -> dict:
  """Compiles one variant and warms it up; returns its runner."""
  init, step = factory()
  state = init(params)
  params = jax.tree.map(jnp.copy, params)
  jitted = jax.jit(step, donate_argnums=(0, 1))
  t0 = time.perf_counter()
  compiled = jitted.lower(params, state, grads).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  for _ in range(3):  # warm-up
    params, state = compiled(params, state, grads)
  jax.block_until_ready(params)
  return {
    "compiled": compiled,
    "carry": (params, state),
    "grads": grads,
    "times": [],
    "rounds": [],
    "compile_s": compile_s,
    "temp_bytes": temp,
  }


def fresh_compile_seconds(kind: str, total: int, name: str, prelude: str = "") -> float:
  """Seconds to lower and compile variant ``name`` in a new Python process: XLA keeps the
  kernels it compiled for earlier variants of the same process and reuses them, so the
  ``compile_s`` of every variant but the first understates what a restart pays.
  ``prelude``: Python statements run first in that process (after ``benchmarks/`` is on
  ``sys.path``). One process: see :func:`median_fresh_compile` for repeated ones."""
  here = __file__.rsplit("/", 1)[0]
  code = (
    f"import sys, time, jax; sys.path.insert(0, {here!r}); {prelude + '; ' if prelude else ''}"
    "import step_overhead as b; "
    f"params = b.make_tree({kind!r}, {total}); init, step = b.VARIANTS[{name!r}][0](); "
    "state = init(params); grads = jax.tree.map(lambda p: p * 1e-3, params); "
    "t = time.perf_counter(); "
    "jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile(); "
    "print(time.perf_counter() - t)"
  )
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  return float(out.stdout.split()[-1])


def median_fresh_compile(jobs: dict, repeats: int = 3) -> dict:
  """``{key: median seconds}`` of :func:`fresh_compile_seconds` for each ``key: (kind,
  total, name, prelude)`` of ``jobs``, each run ``repeats`` times, the jobs interleaved
  (so that drift in the machine's load hits each alike)."""
  times: dict = {key: [] for key in jobs}
  for _ in range(repeats):
    for key, job in jobs.items():
      times[key].append(fresh_compile_seconds(*job))
  return {key: statistics.median(t) for key, t in times.items()}


def add_fresh_compile(rows: dict, kind: str, total: int) -> None:
  """Each row's ``compile_fresh_s`` (median of 3 new processes) and its ratio to bare
  Adam's."""
  seconds = median_fresh_compile({name: (kind, total, name, "") for name in rows})
  for name, r in rows.items():
    r["compile_fresh_s"] = seconds[name]
  if "bare_adam" in rows:
    for r in rows.values():
      r["compile_fresh_ratio_to_bare_adam"] = (
        r["compile_fresh_s"] / rows["bare_adam"]["compile_fresh_s"]
      )


def time_round(run: dict, steps: int) -> None:
  params, state = run["carry"]
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    params, state = run["compiled"](params, state, run["grads"])
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t)
  run["carry"] = (params, state)
  run["times"] += times
  run["rounds"].append(statistics.median(times))


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--steps", type=int, default=60, help="timed steps per variant (>= 20 recommended)"
  )
  ap.add_argument(
    "--rounds", type=int, default=20, help="interleaved rounds the steps are split into"
  )
  ap.add_argument("--params", type=int, default=8_000_000, help="parameters per tree")
  ap.add_argument(
    "--trees", default="big,many", help="comma list of: big (8 leaves), many (200 leaves)"
  )
  ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
  ap.add_argument(
    "--fresh-compile",
    action="store_true",
    help="also time each variant's compilation in new processes (compile_fresh_s, median of 3)",
  )
  args = ap.parse_args(argv)
  out = {
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0]),
    "params": args.params,
    "steps": args.steps,
    "results": {},
  }
  for kind in args.trees.split(","):
    params = make_tree(kind, args.params)
    finite_grads = jax.tree.map(lambda p: p * 1e-3, params)
    bad_grads = dict(finite_grads)
    first = min(bad_grads)
    bad_grads[first] = bad_grads[first].at[0].set(jnp.inf)
    runs = {}
    for name in args.variants.split(","):
      factory, nonfinite = VARIANTS[name]
      runs[name] = prepare(factory, params, bad_grads if nonfinite else finite_grads)
      print(
        f"compiled {kind}/{name} in {runs[name]['compile_s']:.1f} s", file=sys.stderr, flush=True
      )
    for _ in range(args.rounds):  # interleaved, so that load drift hits every variant alike
      for run in runs.values():
        time_round(run, max(1, args.steps // args.rounds))
    rows = {
      name: {
        "median_s": statistics.median(r["times"]),
        "compile_s": r["compile_s"],
        "temp_bytes": r["temp_bytes"],
      }
      for name, r in runs.items()
    }
    for ref in ("bare_adam", "floor", "floor_wait", "floor_cond_skip", "floor_where_skip"):
      if ref in rows:
        for name, r in rows.items():
          r[f"ratio_to_{ref}"] = r["median_s"] / rows[ref]["median_s"]
          r[f"paired_ratio_to_{ref}"] = statistics.median(
            a / b for a, b in zip(runs[name]["rounds"], runs[ref]["rounds"])
          )
    del runs
    if args.fresh_compile:
      add_fresh_compile(rows, kind, args.params)
    out["results"][kind] = {"leaves": len(params), **rows}
  print(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  main()
