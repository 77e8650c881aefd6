"""What an optimizer step compiles to on an NVIDIA GPU, read on a machine without one.

XLA compiles for a GPU it is only told about: ``jax.experimental.topologies`` builds a
one-GPU topology from a target spec (``gpu_targets/``, XLA's ``GpuTargetConfigProto``
texts), ``jax.jit(...).lower(...).compile()`` runs XLA:GPU's whole pipeline for it, and
the optimized HLO names the kernels the GPU would launch. Nothing runs: :func:`summarize`
reads the entry computation's kernels off the HLO text.

Setup (on the CPU; the CUDA plugin compiles without a driver), the versions of jax's::

    pip install "jax-cuda12-plugin==$(python -c 'import jax; print(jax.__version__)')" \\
        "jax-cuda12-pjrt==$(python -c 'import jax; print(jax.__version__)')" nvidia-cuda-nvcc-cu12
    python benchmarks/gpu_program.py --target h100_sxm --tree 1b --cases default

A first try: ``--params 1e7 --leaves 16 --cases default`` (seconds); every case at 1B
parameters takes about 15 minutes on 2 CPU cores. The cases are in ``gpu_cases.py``
(groups: ``all``, ``default``, ``targets``, ``train_step``, the train step of the main
example at GPT-2 small's size whatever ``--tree``). The results go to ``--json``, or,
for a case group at the default sizes, to ``benchmarks/gpu_program_<target>_<tree>.json``
(``..._<group>.json`` for a group other than ``all``); other runs without ``--json``
only print. Run it as a script, in a process of its own: before JAX starts its backends
it sets the environment the plugin needs (no driver check, no GPU looked for, CUDA after
the CPU among the platforms: :data:`ENVIRONMENT`). With the plugin installed, any JAX
program on a machine without a GPU logs that no CUDA driver is found (and a plain one
without ``JAX_PLATFORMS=cpu`` a plugin error before it falls back to the CPU): install it
in a virtual environment of its own, or set ``JAX_PLATFORMS=cpu`` for other work.

Columns: ``GB`` the bytes the kernels move; ``x bare`` against the case's baseline
(the bare optimizer); ``kernels``, of which ``kLoop`` are elementwise and ``kInput``
built around a reduction; ``merged`` the parameter-sized outputs computed inside
reduction kernels (and ``merged GB`` their bytes); ``cond`` conditionals; ``host``
host transfers and callbacks; ``copy`` copies.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "gpu_targets")
KNOWN = sorted(f[: -len(".txtpb")] for f in os.listdir(TARGETS) if f.endswith(".txtpb"))


def plugin_missing() -> str | None:
  """None when the CUDA plugin is installed; else the line that installs it."""
  found = importlib.util.find_spec  # a submodule's look-up raises without its package
  if found("jax_plugins") and found("jax_plugins.xla_cuda12") and found("nvidia"):
    return None
  import jax

  v = jax.__version__
  return (
    "the CUDA plugin is not installed; compiling for a GPU target needs it (no GPU):\n"
    f"  pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12"
  )


def target_path(target: str) -> str:
  """The spec file of ``target`` (a name in ``gpu_targets/``, or a path); ValueError naming
  the known targets otherwise, or saying why a path is no target spec."""
  if os.path.exists(target):
    if not os.path.isfile(target):
      raise ValueError(f"--target {target!r} is not a file: give a spec's path or a name")
    with open(target) as f:
      if not re.search(r"^\s*gpu_device_info\s*\{", f.read(), re.MULTILINE):
        raise ValueError(
          f"--target {target!r} holds no gpu_device_info: not a GPU target spec "
          f"(GpuTargetConfigProto text, as in {TARGETS})"
        )
    return target
  if target not in KNOWN:
    raise ValueError(f"unknown GPU target {target!r}; known targets: {', '.join(KNOWN)}")
  return os.path.join(TARGETS, f"{target}.txtpb")


def _without_field(text: str, name: str) -> str:
  """``text`` (a text proto) without its ``name: value`` lines and ``name { ... }`` blocks."""
  out, depth = [], 0
  for line in text.splitlines():
    s = line.strip()
    if depth:
      depth += s.count("{") - s.count("}")
    elif re.match(rf"{name}\s*[:{{]", s):
      depth = s.count("{") - s.count("}")
    else:
      out.append(line)
  return "\n".join(out) + "\n"


@functools.cache
def topology(target: str = "h100_sxm"):
  """The one-GPU topology of ``target``. A spec field the installed plugin's proto lacks
  is named by the parser on the C++ stderr; it is dropped and the spec parsed again
  (``topology(t).dropped_fields`` lists them)."""
  import jax
  from jax.experimental import topologies

  jax.config.update("jax_default_device", jax.devices("cpu")[0])  # eager work on the CPU
  path = target_path(target)
  with open(path) as f:
    text = f.read()
  dropped: list[str] = []
  while True:
    with tempfile.TemporaryFile() as log:
      saved = os.dup(2)
      os.dup2(log.fileno(), 2)
      try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
        topo.dropped_fields = dropped
        return topo
      except Exception as e:  # noqa: BLE001 (the parser says what failed on stderr)
        error = e
      finally:
        os.dup2(saved, 2)
        os.close(saved)
      log.seek(0)
      said = log.read().decode(errors="replace")
    unknown = re.search(r'has no field named "(\w+)"', said)
    if not unknown or unknown.group(1) in dropped or unknown.group(1) == "gpu_device_info":
      raise RuntimeError(f"{path}: {error}\n{said[-2000:]}") from error
    dropped.append(unknown.group(1))
    text = _without_field(text, unknown.group(1))


def on_gpu(tree, target: str = "h100_sxm"):
  """``tree``'s arrays or ``ShapeDtypeStruct``s as structs on ``target``'s one GPU."""
  import jax
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec

  where = NamedSharding(topologies.make_mesh(topology(target), (1,), ("x",)), PartitionSpec())

  def struct(x):
    weak = bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where, weak_type=weak)

  return jax.tree.map(struct, tree)


def compile_for_gpu(fn, *structs, target: str = "h100_sxm", donate_argnums=()) -> str:
  """The optimized HLO text of ``jax.jit(fn, donate_argnums=...)`` compiled for ``target``.
  Donated buffers are reused by outputs of their shapes in order: return them in the
  order they came in."""
  import jax

  lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*on_gpu(structs, target))
  return lowered.compile().as_text()


BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")  # f32[1024,8], f8e4m3fn[2]
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
# Instructions that launch nothing: they name, pack or unpack buffers.
NO_KERNEL = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
             "opt-barrier", "add-dependency", "partition-id", "replica-id"}  # fmt: skip
HOST = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}
# What the CUDA plugin needs to compile without a GPU, set before JAX starts its backends.
ENVIRONMENT = {
  "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
  "CUDA_VISIBLE_DEVICES": "-1",
  "JAX_PLATFORMS": "cpu,cuda",
  "TF_CPP_MIN_LOG_LEVEL": "2",
}


def _arrays(shape: str) -> list[tuple[int, int]]:
  """``(elements, bytes)`` of each array of a shape (each leaf of a tuple)."""
  out = []
  for dtype, dims in ARRAY.findall(shape):
    n = math.prod(int(d) for d in dims.split(",") if d)
    out.append((n, n * BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)))
  return out


def _closing(s: str, i: int) -> int:
  """The index just past the parenthesis that closes the one at ``s[i]``."""
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  return len(s)


def parse(hlo: str) -> tuple[dict, str]:
  """``({computation: [(name, shape, opcode, operands, attributes)]}, entry's name)``."""
  comps: dict = {}
  entry, current = "", None
  for line in hlo.splitlines():
    head = HEADER.match(line)
    if head:
      current = comps.setdefault(head.group(2), [])
      entry = head.group(2) if head.group(1) else entry
      continue
    m = INSTR.match(line) if current is not None else None
    if not m:
      continue
    rest = m.group(2)
    cut = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:cut], rest[cut:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if op:
      end = _closing(rest, op.end() - 1)
      operands = re.findall(r"%([\w.\-]+)", rest[op.end() : end - 1])
      current.append((m.group(1), shape, op.group(1), operands, rest[end:]))
  return comps, entry


def _called(attrs: str) -> list[str]:
  """The computations a conditional, while or call runs."""
  keys = r"(?:true_computation|false_computation|body|condition|to_apply)"
  names = re.findall(keys + r"=%([\w.\-]+)", attrs)
  branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
  return names + (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else [])


def _is_host(op: str, attrs: str) -> bool:
  """Whether an instruction moves data between the host and the GPU (a transfer, or a
  host callback)."""
  target = re.search(r'custom_call_target="([^"]+)"', attrs) if op == "custom-call" else None
  return op in HOST or bool(target and re.search(r"(?i)callback|host", target.group(1)))


def _kernels(comps: dict, name: str, counts: dict) -> list[dict]:
  """The kernels computation ``name`` launches: its own, those of each while's body and
  condition (once: trip counts are unknown), those of each conditional's costliest branch."""
  shapes = {i[0]: i[1] for i in comps[name]}
  out = []
  for iname, shape, op, operands, attrs in comps[name]:
    if _is_host(op, attrs):
      counts["host"] = counts.get("host", 0) + 1
    if op in ("conditional", "while", "call"):
      counts[op] = counts.get(op, 0) + 1
      parts = [_kernels(comps, c, counts) for c in _called(attrs) if c in comps]
      if op == "conditional":
        parts = [max(parts, key=lambda ks: sum(k["bytes"] for k in ks), default=[])]
      out += [k for ks in parts for k in ks]
    elif op not in NO_KERNEL:
      kind = op
      if op == "fusion":
        kind = re.search(r"kind=(k\w+)", attrs).group(1)
        custom = re.search(r'"kind":"([^"]+)"', attrs) if kind == "kCustom" else None
        kind += f"({custom.group(1)})" if custom else ""
        kind += "/multi" if shape.startswith("(") else ""
      ins, outs = [a for o in operands for a in _arrays(shapes.get(o, ""))], _arrays(shape)
      nbytes = sum(b for _, b in ins + outs)
      out.append(dict(name=iname, kind=kind, bytes=nbytes, ins=ins, outs=outs))
  return out


def summarize(hlo: str, min_elems: int = 4096) -> dict:
  """Counts and bytes of the kernels of the entry computation.

  ``gb``: each kernel's operand plus output bytes, summed: a model of the memory traffic
  (no caching, every operand read whole), not of time. A ``kInput`` fusion is a kernel
  built around a reduction. Its *merged* outputs are those of elementwise size (at least
  ``min_elems`` elements and at least half those of its largest operand: a reduction's
  own results are far smaller than what it reads): elementwise results, an optimizer's
  new parameters or moments, computed inside a reduction's kernel with its thread layout.
  ``host``: transfers between host and GPU and host callbacks; ``conditionals``: each
  one reads its predicate back to the host."""
  comps, entry = parse(hlo)
  counts: dict = {}
  kernels = _kernels(comps, entry, counts)
  kinds: dict = {}
  for k in kernels:
    kinds[k["kind"]] = kinds.get(k["kind"], 0) + 1
    top = max((n for n, _ in k["ins"]), default=0)
    big = [(n, b) for n, b in k["outs"] if n >= min_elems and 2 * n >= top]
    k["merged"] = big if k["kind"].startswith("kInput") else []
  gb = lambda ks: sum(k["bytes"] for k in ks) / 1e9
  kin = [k for k in kernels if k["kind"].startswith("kInput")]
  merged = [k for k in kin if k["merged"]]
  return dict(
    kernels=len(kernels),
    kinds=dict(sorted(kinds.items())),
    gb=gb(kernels),
    conditionals=counts.get("conditional", 0),
    whiles=counts.get("while", 0),
    host=counts.get("host", 0),
    copies=sum(k["kind"] in ("copy", "copy-start") for k in kernels),
    kinput=len(kin),
    kinput_gb=gb(kin),
    merged_outputs=sum(len(k["merged"]) for k in merged),
    merged_gb=sum(b for k in merged for _, b in k["merged"]) / 1e9,
  )


COLUMNS = ("GB", "x bare", "kernels", "kLoop", "kInput", "merged", "merged GB", "cond", "host",
           "copy", "compile s")  # fmt: skip


def _row(s: dict, bare_gb: float | None) -> list:
  loops = sum(n for k, n in s["kinds"].items() if k.startswith("kLoop"))
  ratio = f"{s['gb'] / bare_gb:.3f}" if bare_gb else "-"
  return [f"{s['gb']:.2f}", ratio, s["kernels"], loops, s["kinput"], s["merged_outputs"],
          f"{s['merged_gb']:.2f}", s["conditionals"], s["host"], s["copies"],
          f"{s['compile_s']:.1f}"]  # fmt: skip


def table(out: dict) -> str:
  """The results as a text table, each case's bytes against its baseline's."""
  rows = [["case", *COLUMNS]]
  for name, s in out["cases"].items():
    base = out["cases"].get(s.get("baseline", ""), {}).get("gb")
    rows.append([name, *_row(s, base)])
  width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
  cell = lambda i, v: str(v).rjust(width[i]) if i else str(v).ljust(width[i])
  return "\n".join("  ".join(cell(i, v) for i, v in enumerate(r)) for r in rows)


def _fresh(args: argparse.Namespace, name: str) -> dict:
  """Case ``name`` compiled in a new Python process (XLA reuses kernels within one)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "out.json")
    command = [sys.executable, os.path.abspath(__file__), "--target", args.target,
               "--tree", args.tree, "--leaves", str(args.leaves), "--cases", name,
               "--json", path]  # fmt: skip
    if args.params:
      command += ["--params", str(args.params)]
    subprocess.run(command, check=True, capture_output=True)
    with open(path) as f:
      return json.load(f)["cases"][name]


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace, gpu_cases) -> list[str]:
  """The case names ``args`` asks for, every argument checked (a usage error otherwise)."""
  try:
    target_path(args.target)
  except ValueError as e:
    ap.error(str(e))
  if args.params is not None and not 0 < args.params < float("inf"):
    ap.error(f"--params must be a positive number of parameters, got {args.params}")
  if args.leaves < 1 or args.repeats < 1:
    ap.error(f"--leaves and --repeats must be at least 1, got {args.leaves}, {args.repeats}")
  if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
    ap.error(f"--json {args.json!r}: its folder does not exist")
  names = gpu_cases.GROUPS.get(args.cases) or args.cases.split(",")
  unknown = [n for n in names if n not in gpu_cases.CASES]
  if unknown:
    ap.error(f"unknown cases {unknown}; known: {', '.join(gpu_cases.CASES)}")
  return names


def main(argv=None) -> dict:
  sys.path.insert(0, HERE)
  import gpu_cases

  ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--target", default="h100_sxm", help=f"one of {', '.join(KNOWN)}, or a path")
  ap.add_argument("--tree", default="1b", choices=sorted(gpu_cases.TREES), help="the parameters")
  ap.add_argument("--params", type=float, help="float32 parameters of the '1b' tree (default 1e9)")
  ap.add_argument("--leaves", type=int, default=256, help="leaves of the '1b' tree")
  groups = sorted(gpu_cases.GROUPS)
  ap.add_argument("--cases", default="all", help=f"comma list of cases, or one of {groups}")
  ap.add_argument("--repeats", type=int, default=1, help="compiles per case, each in a new process")
  ap.add_argument("--json", help="where to write the results (default: beside this file)")
  args = ap.parse_args(argv)
  names = _checked(ap, args, gpu_cases)
  missing = plugin_missing()
  if missing:
    raise SystemExit(missing)
  os.environ.update(ENVIRONMENT)
  import jax

  tree = gpu_cases.TREES[args.tree](args.params or 1e9, args.leaves)
  topo = topology(args.target)
  out = {"target": args.target, "device": topo.devices[0].device_kind, "jax": jax.__version__,
         "dropped_spec_fields": topo.dropped_fields, "tree": args.tree,
         "leaves": len(jax.tree.leaves(tree)), "params": sum(x.size for x in jax.tree.leaves(tree)),
         "command": " ".join(["python benchmarks/gpu_program.py", *(argv or sys.argv[1:])]),
         "cases": {}}  # fmt: skip
  if args.repeats > 1:  # each compile in a new process, the cases interleaved
    runs: dict = {name: [] for name in names}
    for _ in range(args.repeats):
      for name in names:
        runs[name].append(_fresh(args, name))
    for name, results in runs.items():
      seconds = [r["compile_s"] for r in results]
      median = statistics.median(seconds)
      out["cases"][name] = dict(results[0], compile_s=median, compile_runs=seconds)
  for name in names if args.repeats <= 1 else ():
    case = gpu_cases.CASES[name]
    fn, structs, donate = case.build(tree)
    t = time.perf_counter()
    hlo = compile_for_gpu(fn, *structs, target=args.target, donate_argnums=donate)
    summary = summarize(hlo)
    out["cases"][name] = dict(summary, compile_s=time.perf_counter() - t, baseline=case.baseline)
    said = f"{name}: {summary['gb']:.2f} GB, {summary['kernels']} kernels"
    print(said, file=sys.stderr, flush=True)
  print(f"{out['device']} ({args.target}), {out['params']:,} parameters in {out['leaves']} leaves")
  print(table(out))
  path = args.json or _default_path(args)
  if path:
    with open(path, "w") as f:
      json.dump(out, f, indent=1)
  return out


def _default_path(args: argparse.Namespace) -> str | None:
  """Where a run without ``--json`` writes: a case group at the default sizes only."""
  import gpu_cases

  if args.params is not None or args.leaves != 256 or args.cases not in gpu_cases.GROUPS:
    return None
  group = "" if args.cases == "all" else f"_{args.cases}"
  target = os.path.splitext(os.path.basename(args.target))[0]
  return os.path.join(HERE, f"gpu_program_{target}_{args.tree}{group}.json")


if __name__ == "__main__":
  main()
