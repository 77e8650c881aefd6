"""README.md's promises: what `pip install -e .` and each extra bring is what
pyproject.toml declares; `locate` as the README calls it."""

import pathlib
import re
import tomllib

import jax.numpy as jnp
import pytest

import optax_dls

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The README's names for packages whose distribution name differs.
DISTRIBUTION = {"pytorch": "torch"}


def _names(requirements):
  return {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower() for req in requirements}


def _readme_extras():
  """``{extra: [package, ...]}`` from the README's table of extras."""
  text = (ROOT / "README.md").read_text().split("## Install")[1].split("\n## ")[0]
  extras = {}
  for extra, brings in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.MULTILINE):
    items = re.split(r", (?:and )?| and ", brings.strip())
    packages = []
    for item in items:
      item = item.removeprefix("the oracles ").strip()
      if item.startswith("the "):  # "the docs' tools": the docs extra, checked there
        continue
      packages.append(DISTRIBUTION.get(item.lower(), item.lower()))
    extras[extra] = packages
  return extras


def test_readme_install_table_is_what_pyproject_declares():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  # "`pip install -e .` brings jax, jaxlib and optax only"
  assert _names(project["dependencies"]) == {"jax", "jaxlib", "optax"}
  declared = project["optional-dependencies"]
  extras = _readme_extras()
  assert set(extras) == set(declared)  # every extra has a row, and no row names another
  for extra, packages in extras.items():
    missing = set(packages) - _names(declared[extra])
    assert not missing, f"README says the {extra} extra brings {missing}; pyproject does not"
  assert set(extras["test"]) >= {"torch", "jmp", "keras", "megatron-core"}
  assert _names(declared["docs"]) <= _names(declared["test"])  # "the docs' tools"


def test_locate_refuses_a_loss_function_that_does_not_return_a_scalar():
  # README's quick start: locate takes the unscaled loss function; its loss_fn, which
  # returns (S * loss, loss), would be a vector loss scaled twice. As jax.grad does,
  # locate refuses a loss that is not a scalar, and says has_aux=True for a pair.
  params, x = {"w": jnp.ones(3)}, jnp.full(3, 2.0, jnp.float16)

  def model_loss(p, x):
    return jnp.sum((x * p["w"].astype(jnp.float16)) ** 2).astype(jnp.float32)

  pair = lambda p, x: (model_loss(p, x) * 8.0, model_loss(p, x))
  with pytest.raises(TypeError, match=r"has_aux=True"):
    optax_dls.locate(pair, params, x)
  with pytest.raises(TypeError, match=r"scalar.*\(3,\)"):
    optax_dls.locate(lambda p, x: x * p["w"], params, x)
  assert optax_dls.locate(pair, params, x, scale=1.0, has_aux=True).first is None
  assert optax_dls.locate(model_loss, params, x, scale=8.0).first is None


def test_pre_commit_runs_ruff_and_mypy_at_the_dev_extra_s_versions():
  # README.md:Install: the `dev` extra brings the tools CI runs, and
  # `.pre-commit-config.yaml` runs ruff and mypy on each commit, pinned alike.
  config = (ROOT / ".pre-commit-config.yaml").read_text()
  hooks = set(re.findall(r"^\s+- id: ([\w-]+)$", config, re.MULTILINE))
  assert {"ruff-check", "ruff-format", "mypy"} <= hooks
  dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
    "dev"
  ]
  pins = {req.split("==")[0]: req for req in dev if "==" in req}
  assert set(pins) >= {"ruff", "mypy"}
  for tool, pin in pins.items():
    assert f"{pin}" in config, f"{tool}: dev extra pins {pin}; .pre-commit-config.yaml does not"


def test_the_main_example_averages_each_step_over_65536_tokens_of_64_replicas():
  # README.md:The main example: "Each step averages its loss over 65,536 tokens, as
  # data-parallel training on 64 replicas does", and it trains four runs.
  import sys

  sys.path.insert(0, str(ROOT / "examples"))
  try:
    import train_lm
  finally:
    sys.path.remove(str(ROOT / "examples"))
  args = train_lm.parse_args([])
  assert args.replicas == 64 and train_lm.tokens_per_step(args) == 65_536
  table = (ROOT / "README.md").read_text().split("## The main example")[1].split("\n## ")[0]
  runs = re.findall(r"^\|?\s*(fp[\w-]+)\s*\|?\s+\d", table, re.MULTILINE)
  assert runs == ["fp32", "fp16", "fp16-dls", "fp16-dls-recompute"]
  assert runs == list(args.runs)  # the runs the command makes by default
