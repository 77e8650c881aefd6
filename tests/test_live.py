"""optax-dls inspect --follow: the runs' state while writers in other processes log them."""

import io
import json
import os
import selectors
import signal
import subprocess
import sys

import numpy as np
import pytest

from optax_dls import cli, writers
from optax_dls._logs import live as _live
from optax_dls._logs import read as _read

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A training loop stand-in: one MetricsWriter row per step, "<step>" on stdout once it is written,
# an overflow in the leaf "decoder/kernel" on every 7th step. Waits for a line on stdin before
# each step when told to (so that a test sees each row arrive), else sleeps a little.
WRITER = """
import sys, time
import numpy as np
from optax_dls import writers

logdir, name, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
scale, skips, last = 2.0**12, 0, 0
with writers.MetricsWriter(
  logdir, run_name=name, tensorboard=False, params=["decoder/kernel", "embed"]
) as w:
  for step in range(steps):
    if mode == "stdin":
      sys.stdin.readline()
    over = step % 7 == 3
    skips += over
    last = step + 1 if over else last
    scale = scale / 2 if over else scale
    w.log(step, {
      "loss_scale": np.float32(scale), "skipped": over, "skip_count": skips,
      "num_steps": step + 1, "nonfinite_step": np.int32(last), "nonfinite_loss": False,
      "nonfinite_leaves": np.array([1 if last else 0], np.uint32),
      "nonfinite_nan": np.zeros(1, np.uint32), "loss": 2.0,
    })
    print(step, flush=True)
    if mode != "stdin":
      time.sleep(float(mode))
"""


def _writer(tmp_path, logdir, name, steps, mode):
  script = tmp_path / "writer.py"
  script.write_text(WRITER)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  return subprocess.Popen(
    [sys.executable, str(script), str(logdir), name, str(steps), mode],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    env=env,
  )


def _line(stream, guard=120.0):
  """The next line of ``stream`` (a pipe); fails rather than hang past ``guard`` seconds."""
  with selectors.DefaultSelector() as sel:
    sel.register(stream, selectors.EVENT_READ)
    assert sel.select(guard), "no output from the subprocess"
  return stream.readline()


def _step_of(line, run):
  """The step a one-line status shows for ``run``."""
  head = f"run {run} step "
  assert line.startswith(head), line
  return int(line[len(head) :].split()[0])


def test_rows_from_a_writer_in_another_process_are_shown_as_they_arrive(tmp_path):
  logdir = tmp_path / "runs"
  follower = _live.Follower(str(logdir))
  assert follower.refresh(block=False)[0] == [f"waiting for logs under {logdir}"]
  proc = _writer(tmp_path, logdir / "a", "a", 12, "stdin")
  try:
    for step in range(12):
      proc.stdin.write("\n")
      proc.stdin.flush()
      assert int(_line(proc.stdout)) == step  # row `step` is in the file now
      (line,), warnings = follower.refresh(block=False)
      assert _step_of(line, "a") == step and warnings == []
  finally:
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
  assert "skips 2 (update ratio 0.8333)" in line
  assert (
    "last 11 updates: 2 skipped" in line
    and "last non-finite step 10 (nonfinite_step 11 in metrics): decoder/kernel (inf)" in line
  )


def test_a_run_that_starts_later_is_picked_up_and_an_empty_one_waits(tmp_path):
  logdir = tmp_path / "runs"
  first = _writer(tmp_path, logdir / "a", "a", 5, "0")
  assert first.wait(timeout=60) == 0
  follower = _live.Follower(str(logdir))
  (line,), _ = follower.refresh(block=False)
  assert _step_of(line, "a") == 4
  (logdir / "b").mkdir()
  (logdir / "b" / writers.JSONL_NAME).touch()  # a writer opened, no row yet
  assert follower.refresh(block=False)[0][1] == "run b waiting (no rows yet)"
  later = _writer(tmp_path, logdir / "b", "b", 3, "0")
  assert later.wait(timeout=60) == 0
  lines, _ = follower.refresh(block=False)
  assert [_step_of(line, run) for line, run in zip(lines, "ab")] == [4, 2] and len(lines) == 2


def _rows_file(path, steps, scale=1024.0, run="r"):
  path.parent.mkdir(parents=True, exist_ok=True)
  rows = [{"step": s, "run": run, "loss_scale": scale, "num_steps": s + 1} for s in steps]
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _steps(follower):
  return [r["step"] for r in follower.logs.runs()["r"]]


def test_a_half_written_last_line_waits_for_its_end(tmp_path):
  path = tmp_path / writers.JSONL_NAME
  _rows_file(path, range(3))
  follower = _live.Follower(str(tmp_path))
  follower.refresh(block=False)
  row = json.dumps({"step": 3, "run": "r", "loss_scale": 2048.0, "num_steps": 4})
  with open(path, "a") as f:
    f.write(row[:10])
  _, warnings = follower.refresh(block=False)
  assert _steps(follower) == [0, 1, 2] and warnings == []  # no bad line reported either
  with open(path, "a") as f:
    f.write(row[10:] + "\n")
  follower.refresh(block=False)
  assert _steps(follower) == [0, 1, 2, 3]


@pytest.mark.parametrize("how", ["truncated", "replaced", "rewritten longer"])
def test_a_file_truncated_or_replaced_starts_over(tmp_path, how):
  path = tmp_path / writers.JSONL_NAME
  _rows_file(path, range(10))
  follower = _live.Follower(str(tmp_path))
  follower.refresh(block=False)
  assert _steps(follower) == list(range(10))
  if how == "truncated":
    with open(path, "r+") as f:
      f.truncate(0)
    _rows_file(path, [100])
    expected = [100]
  elif how == "replaced":
    _rows_file(tmp_path / "new.tmp", [200, 201])
    os.replace(tmp_path / "new.tmp", path)
    expected = [200, 201]
  else:  # in place, the same inode, and longer than before: told by the bytes before the offset
    _rows_file(path, range(300, 320), scale=3.0)
    expected = list(range(300, 320))
  (line,), _ = follower.refresh(block=False)
  assert _steps(follower) == expected and _step_of(line, "r") == expected[-1]


def test_tensorboard_event_files_are_followed_as_they_grow(tmp_path):
  with writers.MetricsWriter(tmp_path / "full", jsonl=False) as w:
    for step in range(6):
      w.log(step, {"loss_scale": 2.0**10, "skip_count": 0, "num_steps": step + 1})
  (full,) = (tmp_path / "full").glob("events.out.tfevents*")
  data = full.read_bytes()
  growing = tmp_path / "run" / full.name
  growing.parent.mkdir()
  growing.write_bytes(data[: len(data) // 2 + 3])  # the writer is in the middle of a record
  follower = _live.Follower(str(tmp_path / "run"))
  (line,), warnings = follower.refresh(block=False)
  assert 0 < _step_of(line, "run") < 5 and warnings == []
  with open(growing, "ab") as f:
    f.write(data[len(data) // 2 + 3 :])
  (line,), warnings = follower.refresh(block=False)
  assert _step_of(line, "run") == 5 and warnings == []
  assert follower.logs.runs()["run"][-1] == {
    "step": 5,
    "loss_scale": 2.0**10,
    "skip_count": 0,
    "num_steps": 6,
  }


def test_a_run_logged_to_tensorboard_only_shows_the_last_non_finite_leaves(tmp_path):
  with writers.MetricsWriter(tmp_path / "tb", jsonl=False, params=["decoder/kernel", "embed"]) as w:
    for step in range(5):
      over = step == 3
      w.log(step, {
        "loss_scale": np.float32(2.0**12), "skipped": over, "skip_count": int(over),
        "num_steps": step + 1, "nonfinite_step": np.int32(4 if step >= 3 else 0),
        "nonfinite_loss": False, "nonfinite_leaves": np.array([2 if step >= 3 else 0], np.uint32),
        "nonfinite_nan": np.array([2 if step >= 3 else 0], np.uint32),
      })  # fmt: skip
  (line,), warnings = _live.Follower(str(tmp_path)).refresh(block=False)
  assert (
    warnings == [] and "last non-finite step 3 (nonfinite_step 4 in metrics): embed (nan)" in line
  ), line


def test_the_terminal_view_is_redrawn_in_place(tmp_path):
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  _rows_file(tmp_path / "a" / writers.JSONL_NAME, range(5), run="a")
  _rows_file(tmp_path / "b" / writers.JSONL_NAME, range(7), run="b")
  out = Terminal()
  assert _live.follow(tmp_path, 0.01, refreshes=2, out=out, err=io.StringIO()) == 0
  first, second = out.getvalue().split("\x1b[")[0], out.getvalue().split("\x1b[", 1)[1]
  drawn = first.count("\n")
  assert "run a  step 4  loss scale 2^10" in first and "run b  step 6" in first
  assert second.startswith(f"{drawn}F\x1b[J")  # back over the first block, then clear
  assert second.count("\n") == drawn


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_ends_the_follower_with_exit_status_0(tmp_path, inherited):
  # "ignored": started as a background job of a shell script is, with SIGINT ignored,
  # which Python keeps ignored unless the program installs a handler.
  _rows_file(tmp_path / writers.JSONL_NAME, range(3))
  command = [sys.executable, "-m", "optax_dls.cli", "inspect", str(tmp_path), "--watch", "0.1"]
  if inherited == "ignored":
    command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
  proc = subprocess.Popen(
    command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )
  try:
    assert _step_of(_line(proc.stdout).split(" ", 1)[1], "r") == 2  # after the time of day
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
  finally:
    proc.kill()
  assert "Traceback" not in proc.stderr.read()


def test_follow_writes_a_line_per_run_only_when_its_status_changes(tmp_path, capsys):
  """In a file or a pipe a finished run is written once, not at every refresh; a run that
  moves on is written again."""
  _rows_file(tmp_path / "a" / writers.JSONL_NAME, range(3), run="a")
  assert cli.main(["inspect", str(tmp_path), "--watch", "0.01", "--max-refreshes", "3"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 1 and " run a step 2 loss scale 2^10 | " in lines[0]
  out = io.StringIO()
  follower = _live.Follower(str(tmp_path))
  screen = _live._Screen(out, io.StringIO(), False, 0.01)
  screen.show(*follower.refresh(block=False))
  screen.show(*follower.refresh(block=False))
  _rows_file(tmp_path / "a" / writers.JSONL_NAME, range(5), run="a")
  screen.show(*follower.refresh(block=False))
  written = out.getvalue().splitlines()
  assert [" step 2 " in w for w in written] == [True, False] and " step 4 " in written[1]


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--watch", "0"], "--watch: must be a number of seconds > 0, got '0'"),
    (["--watch", "soon"], "--watch: must be a number of seconds > 0, got 'soon'"),
    (["--watch", "nan"], "--watch: must be a number of seconds > 0"),
    (["--follow", "--json"], "not allowed with --plot or --json"),
    (["--follow", "--max-refreshes", "0"], "--max-refreshes: must be a whole number >= 1"),
  ],
)
def test_bad_follow_arguments_are_argument_errors(flags, message, tmp_path, capsys):
  assert cli.main(["inspect", str(tmp_path), *flags]) == 2
  assert message in capsys.readouterr().err


def test_warnings_are_shown_once_each(tmp_path):
  path = tmp_path / writers.JSONL_NAME
  _rows_file(path, range(2))
  with open(path, "a") as f:
    f.write("garbage\n")
  follower = _live.Follower(str(tmp_path))
  _, warnings = follower.refresh(block=False)
  assert len(warnings) == 1 and "line 3" in warnings[0]
  assert follower.refresh(block=False)[1] == []


def test_without_tensorboard_the_follower_says_so_once(tmp_path, monkeypatch):
  with writers.MetricsWriter(tmp_path / "tb", jsonl=False) as w:
    w.log(0, {"loss_scale": 1.0})
  _rows_file(tmp_path / "js" / writers.JSONL_NAME, range(2))
  monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_file_loader", None)
  follower = _live.Follower(str(tmp_path))
  lines, warnings = follower.refresh(block=False)
  assert _step_of(lines[0], "r") == 1 and len(warnings) == 1
  assert 'pip install -e ".[monitoring]"' in warnings[0]
  assert follower.refresh(block=False)[1] == []


def test_a_corrupt_event_record_is_reported_once_the_file_stops_growing(tmp_path):
  with writers.MetricsWriter(tmp_path, jsonl=False) as w:
    for step in range(4):
      w.log(step, {"loss_scale": np.float32(2.0**step)})
  (path,) = tmp_path.glob("events.out.tfevents*")
  data = bytearray(path.read_bytes())
  data[-6] ^= 0xFF  # the value of the last record
  path.write_bytes(bytes(data))
  log = _read.LogFile(str(path), "events")
  assert [r["step"] for r in log.read()[0]] == [0, 1, 2] and log.read()[1] != []
  assert log.read()[1] == []  # once


def test_following_a_file_that_is_not_a_folder_exits_2(tmp_path, capsys):
  (tmp_path / "notes.txt").write_text("not logs")
  assert cli.main(["inspect", str(tmp_path / "notes.txt"), "--follow"]) == 2
  assert "is not a folder" in capsys.readouterr().err
