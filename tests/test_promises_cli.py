"""The promises of the ``optax_dls.cli`` docstrings not held elsewhere."""

from __future__ import annotations

import json
import sys

import pytest

from optax_dls import cli
from optax_dls._logs.read import NoLogsError
from optax_dls._logs.report import inspect


def _log(path, rows):
  path.mkdir(parents=True)
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_without_num_steps_each_logged_step_is_one_update(tmp_path):
  _log(
    tmp_path / "a",
    [{"step": s, "loss_scale": 1024.0, "skip_count": int(s >= 4)} for s in range(10)],
  )
  summary = json.loads(inspect(tmp_path, as_json=True))["a"]["summary"]
  assert (summary["updates"], summary["applied_updates"], summary["skips"]) == (10, 9, 1)


def test_the_report_ends_with_the_plot_s_path(tmp_path):
  pytest.importorskip("matplotlib")
  _log(tmp_path / "a", [{"step": s, "loss_scale": 1024.0} for s in range(3)])
  out = tmp_path / "scale.png"
  assert inspect(tmp_path / "a", plot_path=out).endswith(f"\nplot written to {out}")
  assert out.stat().st_size > 0


@pytest.mark.parametrize("flags, interval", [(["--follow"], 2.0), (["--watch", "0.5"], 0.5)])
def test_follow_refreshes_every_2_seconds_unless_watch_says(tmp_path, monkeypatch, flags, interval):
  seen = []
  monkeypatch.setattr(
    cli._live, "follow", lambda run_dir, every, refreshes: seen.append(every) or 0
  )
  assert cli.main(["inspect", str(tmp_path), *flags]) == 0
  assert seen == [interval]


def test_main_reads_sys_argv_by_default(tmp_path, monkeypatch, capsys):
  _log(tmp_path / "a", [{"step": 0, "loss_scale": 1024.0}])
  monkeypatch.setattr(sys, "argv", ["optax-dls", "inspect", str(tmp_path), "--json"])
  assert cli.main() == 0
  assert "a" in json.loads(capsys.readouterr().out)


def test_inspect_raises_no_logs_error_without_readable_logs(tmp_path):
  (tmp_path / "notes.txt").write_text("nothing here")
  with pytest.raises(NoLogsError):
    inspect(tmp_path)
  _log(tmp_path / "bad", [])
  (tmp_path / "bad" / "metrics.jsonl").write_text("not json\n")
  with pytest.raises(NoLogsError):
    inspect(tmp_path / "bad")


def test_an_unreadable_file_is_skipped_with_a_warning_and_the_others_are_read(tmp_path, capsys):
  _log(tmp_path / "a", [{"step": 0, "loss_scale": 8.0}])
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "metrics.jsonl").symlink_to(tmp_path / "missing")
  assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
  captured = capsys.readouterr()
  assert list(json.loads(captured.out)) == ["a"]
  assert "metrics.jsonl: unreadable (FileNotFoundError" in captured.err
