"""A run directory is the trainer's only when it proves it: nothing the trainer did not write
is overwritten, moved or deleted (``reco_megatron.trainer.lifecycle.run_dir``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reco_megatron.config import ConfigError
from reco_megatron.megatron.checkpoint.ownership import mark_owner
from reco_megatron.megatron.checkpoint.resume import remove_partial_checkpoints
from reco_megatron.train import main
from reco_megatron.trainer.lifecycle import run_dir, take_run_directory
from reco_megatron.trainer.lifecycle.run_lock import LOCK_NAME
from tests.tiny_overrides import TINY_RUN


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def _someone_elses(out: Path) -> None:
    (out / "checkpoints" / ".tmp-step_mywork").mkdir(parents=True)
    (out / "checkpoints" / ".tmp-step_mywork" / "keep.txt").write_text("mine")
    (out / "checkpoints" / ".pruned-notes").write_text("mine too")
    (out / "notes.txt").write_text("my notes")
    (out / "config.yaml").write_text("mine: 1\n")
    (out / "metrics.jsonl").write_text('{"step": 9, "mine": true}\n')


def test_a_directory_of_someone_elses_files_is_refused_and_untouched(tmp_path, capsys) -> None:
    """Before: exit 0, .tmp-step_mywork/ and .pruned-notes deleted, config.yaml overwritten,
    metrics.jsonl moved to metrics.jsonl.discarded."""
    out = tmp_path / "theirs"
    _someone_elses(out)
    before = _tree(out)
    args = [*TINY_RUN, "sft.steps=0", "trainer.max_steps=1", f"trainer.output_dir={out}"]
    code = main(["examples/tiny_cpu.yaml", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("reco-train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "is not a reco-megatron run directory" in lines[0]
    assert "notes.txt" in lines[0] and "choose an empty or new directory" in lines[0]
    assert _tree(out) == before


def test_new_and_empty_directories_are_marked(tmp_path) -> None:
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        lock, run_id = take_run_directory(out, 0)
        try:
            assert run_dir.read_run_id(out) == run_id and len(run_id) == 16
        finally:
            lock.release()
        again, same = take_run_directory(out, 0)  # a resume keeps its id
        again.release()
        assert same == run_id


def test_a_run_directory_of_an_earlier_release_is_adopted(tmp_path, caplog) -> None:
    """Older releases wrote no run.json: their config_history.jsonl (or checkpoints/latest
    with a checkpoint) shows the trainer made the directory."""
    by_history = tmp_path / "a"
    by_history.mkdir()
    record = {"from_step": 0, "checkpoint": None, "config": {}, "changes": {}}
    (by_history / "config_history.jsonl").write_text(json.dumps(record) + "\n")
    (by_history / "metrics.jsonl").write_text("{}\n")
    by_checkpoint = tmp_path / "b"
    (by_checkpoint / "checkpoints" / "step_00000002").mkdir(parents=True)
    (by_checkpoint / "checkpoints" / "step_00000002" / "meta.json").write_text("{}")
    (by_checkpoint / "checkpoints" / "latest").write_text("step_00000002\n")
    for out in (by_history, by_checkpoint):
        assert run_dir.foreign_files(out) is None
        lock, run_id = take_run_directory(out, 0)
        lock.release()
        assert json.loads((out / "run.json").read_text())["adopted"] is True
        assert run_dir.read_run_id(out) == run_id
    assert "made by an earlier release" in caplog.text


def test_look_alikes_are_not_proof(tmp_path) -> None:
    out = tmp_path / "x"
    out.mkdir()
    (out / "config_history.jsonl").write_text("my own log\n")
    assert "not a reco-megatron run directory" in run_dir.foreign_files(out)
    (out / "config_history.jsonl").unlink()
    (out / "run.json").write_text("[1, 2]")
    assert "run.json is not a run marker" in run_dir.foreign_files(out)
    (out / "run.json").unlink()
    (out / "run.json").symlink_to("/etc/hostname")
    assert "is a symlink to '/etc/hostname'" in run_dir.foreign_files(out)


def test_only_an_empty_lock_file_counts_as_nothing(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("")  # what an earlier release left after every exit
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    assert run_dir.foreign_files(out) is None
    (out / LOCK_NAME).write_text("someone's notes")
    assert run_dir.foreign_files(out) is not None


def test_only_this_runs_debris_is_removed(tmp_path, caplog) -> None:
    root = tmp_path / "checkpoints"
    for name, owner in [
        (".tmp-step_00000004", "abc"),  # this run's interrupted save
        (".pruned-step_00000001", "abc"),  # this run's interrupted prune
        (".tmp-step_00000005", "other"),  # another run's
        (".tmp-step_mywork", None),  # not the trainer's at all
    ]:
        (root / name / "dist").mkdir(parents=True)
        if owner is not None:
            mark_owner(root / name, owner)
    (root / ".pruned-notes").write_text("mine")
    (root / "latest.tmp").write_text("my latest thoughts, not a checkpoint name")
    assert remove_partial_checkpoints(root, run_id="abc") == [
        ".tmp-step_00000004",
        ".pruned-step_00000001",
    ]
    left = sorted(p.name for p in root.iterdir())
    assert left == [".pruned-notes", ".tmp-step_00000005", ".tmp-step_mywork", "latest.tmp"]
    assert "not marked as this run's" in caplog.text


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_symlinked_look_alike_is_left_and_its_target_kept(tmp_path, kind) -> None:
    target = tmp_path / "precious"
    if kind == "dir":
        (target / "dist").mkdir(parents=True)
        mark_owner(target, "abc")  # even a marked target is never followed
    else:
        target.write_text("keep")
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".tmp-step_00000007").symlink_to(target)
    assert remove_partial_checkpoints(root, run_id="abc") == []
    assert target.exists() and (root / ".tmp-step_00000007").is_symlink()


def test_a_lock_file_that_is_not_ours_is_never_written(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text("someone's notes")
    with pytest.raises(ConfigError, match="not a reco-megatron run directory"):
        take_run_directory(out, 0)
    assert (out / LOCK_NAME).read_text() == "someone's notes"
