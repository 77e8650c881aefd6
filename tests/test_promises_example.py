"""docs/example.md: the default model has about 470k parameters (2 layers, width 128, 4
heads, 64-byte context), and its data is the Python reference manual (about 465 KB), the
last 10% held out."""

import pathlib
import sys

import jax
import jax.numpy as jnp

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import train_lm
from lm.model import Transformer
from lm.precision import FP32


def test_the_default_model_has_470k_parameters_and_the_manual_about_465_kb():
  args = train_lm.parse_args([])
  assert (args.layers, args.d_model, args.heads, args.seq_len, args.steps) == (2, 128, 4, 64, 300)
  model = Transformer(args.d_model, args.layers, args.heads, args.seq_len, FP32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, args.seq_len), jnp.int32))
  n = sum(x.size for x in jax.tree.leaves(shapes["params"]))
  assert round(n, -4) == 470_000, n
  total = args.train.size + args.val.size
  if sys.version_info[:2] == (3, 11):  # the manual the page measures; it grows with Python
    assert 440_000 <= total <= 490_000, total
  else:
    assert total >= 400_000, total
  assert abs(args.val.size / total - 0.1) < 0.01
