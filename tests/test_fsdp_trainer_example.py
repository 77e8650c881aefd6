"""examples/fsdp_trainer.py: an FSDP trainer (8 devices, a jitted init building a flax
TrainState, in/out shardings, donation, MultiSteps, rank promotion "raise")
skips the step whose gradients overflow on one shard, keeps its state bit for bit, backs the
scale off, and resumes from an Orbax checkpoint bit for bit, through one compiled step."""

import pathlib
import sys

import jax
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  promotion = jax.config.jax_numpy_rank_promotion
  sys.path.insert(0, str(EXAMPLES))
  try:
    import fsdp_trainer  # sets jax_numpy_rank_promotion="raise", as a trainer does

    yield fsdp_trainer.main(ckpt_dir=str(tmp_path_factory.mktemp("ckpt")))
  finally:
    sys.path.remove(str(EXAMPLES))
    jax.config.update("jax_numpy_rank_promotion", promotion)  # the other tests' setting


def test_only_the_injected_step_is_skipped_on_every_device_and_keeps_the_state(results):
  assert results["skipped_steps"] == [5]  # no step overflowed float16 on its own
  assert results["devices_skipped"] == 8
  assert results["kept_at_skip"]  # parameters and inner state (MultiSteps' accumulator) bit for bit


def test_the_scale_backs_off_at_the_skip_and_grows_after_clean_steps(results):
  scales = results["loss_scales"]  # after each step
  assert scales[:4] == [2.0**15] * 4 and scales[4] == 2.0**14  # step 5: halved
  assert scales[10] == 2.0**15 and scales[16] == 2.0**16  # 6 clean micro-batches each


def test_the_loss_decreases(results):
  losses = results["losses"]
  assert results["final_loss"] == losses[-1]
  assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses


def test_resumed_from_the_checkpoint_bit_for_bit_through_one_program(results):
  assert results["resumed_equal"]
  assert results["programs"] == 1  # the restored state's types are the live state's
