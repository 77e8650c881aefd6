"""check_dist.py DIST_DIR: the wheel and the sdist in DIST_DIR hold what they should.

The wheel: every module of optax_dls/ in the checkout, py.typed, the LICENSE; nothing
outside the package. The sdist: the same modules, py.typed, LICENSE, README.md,
CHANGELOG.md and pyproject.toml, and no tests (they run from a clone of the repository).
"""

from __future__ import annotations

import pathlib
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
dist = pathlib.Path(sys.argv[1])
modules = {f"optax_dls/{p.name}" for p in (ROOT / "optax_dls").glob("*.py")}
modules |= {
  f"optax_dls/{p.relative_to(ROOT / 'optax_dls').as_posix()}"
  for p in (ROOT / "optax_dls").glob("*/**/*.py")
}
problems = []

(wheel,) = dist.glob("*.whl")
names = set(zipfile.ZipFile(wheel).namelist())
info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
for need in sorted(modules | {"optax_dls/py.typed", f"{info}/licenses/LICENSE"}):
  if need not in names:
    problems.append(f"{wheel.name} lacks {need}")
for name in sorted(names):
  if not name.startswith(("optax_dls/", f"{info}/")):
    problems.append(f"{wheel.name} holds {name}, outside the package")

(sdist,) = dist.glob("*.tar.gz")
with tarfile.open(sdist) as tar:
  members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
for need in sorted(
  modules
  | {"optax_dls/py.typed", "LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO"}
):
  if need not in members:
    problems.append(f"{sdist.name} lacks {need}")
for name in sorted(members):
  if name.split("/")[0] in {"tests", "docs", "examples", "benchmarks", ".ci"}:
    problems.append(f"{sdist.name} holds {name}")

print(f"{wheel.name}: {len(names)} files; {sdist.name}: {len(members)} entries")
for problem in problems:
  print(problem)
sys.exit(1 if problems else 0)
