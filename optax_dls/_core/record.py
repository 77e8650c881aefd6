"""Where a non-finite step came from: which gradient leaves held an inf or a NaN.

The state's ``nonfinite`` field is the record of the last non-finite step, one int32
vector: a code per floating gradient leaf (0 finite, 1 held an infinity, 2 held a NaN),
in ``jax.tree.leaves`` order (the order of the parameters' floating leaves), then the
loss's code (when the loss was handed over) and the step's number. The names are made
here, on the host, from the parameters' key paths; nothing of them enters the compiled
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

WORD_BITS = 32


def counted(
  overflows: dict[str, jax.Array], finite: jax.Array, codes: jax.Array, masks: dict
) -> dict[str, jax.Array]:
  """Each label's count of non-finite steps, one more where a leaf of its group (``masks``:
  bool ``[n]`` per label) was not finite on this non-finite step."""
  bad = lambda label: ~finite & jnp.any(jnp.where(masks[label], codes, 0) > 0)
  return {k: jnp.where(bad(k), optax.safe_increment(v), v) for k, v in overflows.items()}


def group_masks(labels: Sequence[str]) -> dict[str, np.ndarray]:
  """bool ``[n]`` per label: the leaves labelled so (``labels``: one per leaf)."""
  return {label: np.array([x == label for x in labels], bool) for label in sorted(set(labels))}


def pack(flags: Any) -> jax.Array:
  """uint32 ``[max(1, ceil(n / 32))]`` from bool ``[n]``: bit ``k % 32`` of word ``k // 32``."""
  n = flags.shape[0]
  words = num_words(n)
  bits = jnp.pad(flags.astype(jnp.uint32), (0, words * WORD_BITS - n)).reshape(words, WORD_BITS)
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32).reshape(1, WORD_BITS)
  return jnp.sum(bits << shifts, axis=1, dtype=jnp.uint32)


def unpack(words: Any, num_leaves: int) -> np.ndarray:
  """bool ``[num_leaves]`` from the packed words (host side, NumPy)."""
  words = np.asarray(words, np.uint32).reshape(-1)
  bits = (words[:, None] >> np.arange(WORD_BITS, dtype=np.uint32)) & 1
  return bits.reshape(-1)[:num_leaves].astype(bool)


def num_words(num_leaves: int) -> int:
  """The ``uint32`` words of one bit per leaf (at least one)."""
  return max(1, -(-num_leaves // WORD_BITS))


def _key_text(key: Any) -> str:
  """One key of a path as text, a ``/`` or ``\\`` in it escaped by a ``\\``, so that a key
  ``'a/b'`` and the two keys ``'a'``, ``'b'`` give different names."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      text = str(getattr(key, attr))
      break
  else:
    text = str(key).strip(".[]'\"")
  return text.replace("\\", "\\\\").replace("/", "\\/")


def path_name(path: Sequence[Any]) -> str:
  """A key path as ``"params/decoder/layers_3/attn/query/kernel"`` (a ``/`` inside a key
  written ``\\/``)."""
  return "/".join(_key_text(k) for k in path)


def unique(names: Sequence[str]) -> list[str]:
  """``names`` with every repeat of an earlier name suffixed ``#k``, ``k`` its leaf index
  (two keys of one node that read alike, such as ``1`` and ``'1'``, stay apart)."""
  seen: set[str] = set()
  out = []
  for k, name in enumerate(names):
    out.append(name if name not in seen else f"{name}#{k}")
    seen.add(out[-1])
  return out
