"""Cost of recording where a step was not finite, as a ratio to the same step without it.

The record (one bit per gradient leaf for "not finite" and one for "NaN", the loss flag,
the step number) is built from the per-leaf results the all-finite check computes anyway;
what it adds is packing those bits and keeping the last record in the state. This times
``dynamic_loss_scale(optax.adam)`` under the default lowering on the ``tx.update`` +
``optax.apply_updates`` path and on ``apply_step``, with the record (as shipped) and
without it (packing replaced by zeros, the record never updated: a build of the library
without the feature), on 8 and on 200 leaves, in paired rounds; and the compile seconds
of each (lowering and compiling; each variant compiled in its own fresh process, so no
cache is shared; the median of 3). Prints one JSON object. Usage::

    python benchmarks/localisation_cost.py [--steps 60] [--rounds 20] [--params 8000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from optax_dls._core import record as _localisation

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import step_overhead  # the same trees


def _without_record() -> None:
  """Turns the record off: what the library costs without the feature."""
  _localisation.pack = lambda flags: jnp.zeros(
    [_localisation.num_words(flags.shape[0])], jnp.uint32
  )
  _localisation.recorded = lambda record, *args, **kwargs: record


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--params", type=int, default=8_000_000)
  args = ap.parse_args(argv)
  out = {"backend": jax.default_backend(), "params": args.params, "results": {}}
  for kind in ("big", "many"):
    params = step_overhead.make_tree(kind, args.params)
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    rows = {}
    for path, fused in (("update", False), ("apply_step", True)):
      runs = {}
      for name in ("with_record", "without_record"):
        if name == "without_record":
          saved = (_localisation.pack, _localisation.recorded)
          _without_record()
        init, step = step_overhead.ours_step("auto", fused)
        state = init(params)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        if name == "without_record":
          _localisation.pack, _localisation.recorded = saved
        carry = (jax.tree.map(jnp.copy, params), state)
        for _ in range(3):
          carry = compiled(*carry, grads)
        runs[name] = {"compiled": compiled, "carry": carry, "times": [], "rounds": []}
      for _ in range(args.rounds):
        for run in runs.values():
          times = []
          for _ in range(max(1, args.steps // args.rounds)):
            t = time.perf_counter()
            run["carry"] = run["compiled"](*run["carry"], grads)
            jax.block_until_ready(run["carry"])
            times.append(time.perf_counter() - t)
          run["times"] += times
          run["rounds"].append(statistics.median(times))
      w, wo = runs["with_record"], runs["without_record"]
      rows[path] = {
        "with_record_median_s": statistics.median(w["times"]),
        "without_record_median_s": statistics.median(wo["times"]),
        "paired_ratio": statistics.median(a / b for a, b in zip(w["rounds"], wo["rounds"])),
      }
    name, without = (
      "auto_update_finite",
      "import localisation_cost; localisation_cost._without_record()",
    )
    seconds = step_overhead.median_fresh_compile(
      {"with": (kind, args.params, name, ""), "without": (kind, args.params, name, without)}
    )
    compile_with, compile_without = seconds["with"], seconds["without"]
    rows["update"].update(
      compile_with_s=compile_with,
      compile_without_s=compile_without,
      compile_ratio=compile_with / compile_without,
    )
    out["results"][kind] = {"leaves": len(params), **rows}
  print(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  main()
