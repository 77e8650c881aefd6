"""The ``optax-dls inspect --help`` text: what each argument promises."""

import json
import time

import pytest

from optax_dls import cli


def _help(capsys):
  assert cli.main(["inspect", "--help"]) == 0
  return " ".join(capsys.readouterr().out.split())


def _log(path, steps=5):
  path.parent.mkdir(parents=True, exist_ok=True)
  rows = [
    {"step": i, "loss_scale": 2.0**15, "skip_count": 0, "num_steps": i + 1} for i in range(steps)
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_any_jsonl_file_in_a_nested_folder_is_read(tmp_path, capsys):
  """run_dir: "*.jsonl files ... (searched recursively)"."""
  assert "*.jsonl files" in _help(capsys) and "searched recursively" in _help(capsys)
  _log(tmp_path / "a" / "b" / "train.jsonl")
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert list(report) == ["a/b"] and report["a/b"]["summary"]["updates"] == 5


@pytest.mark.parametrize("flags, interval", [([], 2.0), (["--watch", "0.5"], 0.5)])
def test_follow_refreshes_every_2_s_and_watch_every_seconds(
  flags, interval, tmp_path, capsys, monkeypatch
):
  """--follow: "every 2 s"; --watch SECONDS: "like --follow, every SECONDS seconds"."""
  assert "every 2 s" in _help(capsys) and "every SECONDS seconds" in _help(capsys)
  _log(tmp_path / "run" / "metrics.jsonl")
  waits = []
  monkeypatch.setattr(time, "sleep", waits.append)
  follow = ["--follow"] if not flags else flags
  assert cli.main(["inspect", str(tmp_path), *follow, "--max-refreshes", "3"]) == 0
  assert waits == [interval, interval]
  assert "run step 4" in capsys.readouterr().out


def test_follow_is_refused_with_plot(tmp_path, capsys):
  assert cli.main(["inspect", str(tmp_path), "--follow", "--plot", str(tmp_path / "x.png")]) == 2
  assert "not allowed with --plot or --json" in capsys.readouterr().err
