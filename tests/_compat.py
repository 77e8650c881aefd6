"""What the tests use from JAX and optax that moved between the supported versions.

The library supports the floors in pyproject.toml up to the newest releases,
and CI runs the tests at both ends. The helpers here pick the spelling the
installed version has; ``requires_jax`` / ``requires_optax`` skip a test, with
the reason shown in the summary, where it needs a newer release than the floor.
"""

from __future__ import annotations

import jax
import optax
import pytest
from _xla import XLA_DEFAULTS

from optax_dls._core.multi_device import pcast_varying  # noqa: F401 (the tests' spelling of it)
from optax_dls._util.versions import parse

JAX = parse(jax.__version__)

OPTAX = parse(optax.__version__)


def jit_xla_defaults(fun, **kwargs):
  """``jax.jit(fun, **kwargs)`` compiled with :data:`XLA_DEFAULTS`."""
  return jax.jit(fun, compiler_options=XLA_DEFAULTS, **kwargs)


def requires_jax(version: str, reason: str):
  """Skips the test on jax older than ``version``, saying why."""
  return pytest.mark.skipif(
    JAX < parse(version), reason=f"needs jax>={version} (jax {jax.__version__} here): {reason}"
  )


def requires_optax(version: str, reason: str):
  """Skips the test on optax older than ``version``, saying why."""
  return pytest.mark.skipif(
    OPTAX < parse(version),
    reason=f"needs optax>={version} (optax {optax.__version__} here): {reason}",
  )


def enable_x64(on: bool = True):
  """Context manager for 64-bit mode: ``jax.enable_x64`` (jax>=0.8), ``jax.experimental``'s
  before."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(on)
  from jax import experimental

  return experimental.enable_x64(on)


def apply_step(tx, grads, opt_state, params, **extra_args):
  """``tx.update`` then the updates applied (a parameter whose update is None, an Equinox
  model's function, kept as it is), as a training step runs them."""
  import optax

  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  applied = jax.tree.map(
    lambda p, u: p if u is None else optax.apply_updates(p, u),
    params,
    updates,
    is_leaf=lambda x: x is None,
  )
  return applied, opt_state
