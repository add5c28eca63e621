"""A damaged or missing ``latest`` is one line, never a traceback, and
``checkpoint.on_damaged=fallback`` resumes from the newest complete checkpoint that verifies
(with real checkpoints: ``test_checkpoint_integrity``)."""

from __future__ import annotations

import pytest

from reco_megatron.megatron.checkpoint import LatestPointerError, latest_checkpoint
from reco_megatron.megatron.checkpoint.format import complete_checkpoints, read_latest
from reco_megatron.megatron.checkpoint.resume import _start_point
from reco_megatron.megatron.checkpoint.save import _prune

DAMAGED = {
    "empty": b"",
    "non_ascii": b"step_0000\xe90002\n",
    "not_a_name": b"12\n",
    "flipped_digit": b"step_00000009\n",  # names a checkpoint that is not there
    "huge": b"step_" + b"0" * 5000,
}


def _fake_checkpoints(root, *names):
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "meta.json").write_text("{}")


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_damaged_latest_is_one_line_and_fallback_takes_the_newest(tmp_path, kind) -> None:
    _fake_checkpoints(tmp_path, "sft_00000004", "step_00000000", "step_00000001", "step_00000002")
    (tmp_path / "latest").write_bytes(DAMAGED[kind])
    with pytest.raises(LatestPointerError) as info:
        _start_point(tmp_path, "stop")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "latest") in message
    assert "newest complete checkpoint is" in message and "step_00000002" in message
    assert "checkpoint.on_damaged=fallback" in message
    # the newest; latest names nothing usable, so resume_latest rewrites it after the load
    assert _start_point(tmp_path, "fallback") == (tmp_path / "step_00000002", None)


def test_missing_latest_with_checkpoints_is_not_a_fresh_start(tmp_path) -> None:
    assert _start_point(tmp_path, "stop") == (None, None)  # an empty run directory: fresh
    _fake_checkpoints(tmp_path, "step_00000003")
    with pytest.raises(LatestPointerError, match="is missing but 1 complete checkpoint"):
        _start_point(tmp_path, "stop")
    assert _start_point(tmp_path, "fallback") == (tmp_path / "step_00000003", None)


def test_no_checkpoint_to_fall_back_to(tmp_path) -> None:
    (tmp_path / "latest").write_bytes(b"")
    for mode in ("stop", "fallback"):
        with pytest.raises(LatestPointerError, match="no complete checkpoint"):
            _start_point(tmp_path, mode)


def test_sft_checkpoints_come_before_step_zero(tmp_path) -> None:
    _fake_checkpoints(tmp_path, "step_00000010", "step_00000000", "sft_00000040", "sft_00000007")
    (tmp_path / "damaged-step_00000011").mkdir()
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["sft_00000007", "sft_00000040", "step_00000000", "step_00000010"]
    (tmp_path / "latest").write_text("sft_00000040\n")
    assert read_latest(tmp_path) == "sft_00000040"
    assert latest_checkpoint(tmp_path) == tmp_path / "sft_00000040"


@pytest.mark.parametrize(
    ("keep_last", "kept"),
    [
        (1, ["step_00000000", "step_00000002"]),
        (2, ["step_00000000", "step_00000001", "step_00000002"]),
        (0, ["step_00000000", "step_00000001", "step_00000002"]),
    ],
)
def test_keep_last_never_prunes_step_zero_and_drops_finished_sft(tmp_path, keep_last, kept):
    _fake_checkpoints(tmp_path, "sft_00000004", "step_00000000", "step_00000001", "step_00000002")
    _prune(tmp_path, keep_last)
    assert sorted(p.name for p in tmp_path.iterdir()) == kept


def test_sft_checkpoints_stay_until_the_warm_up_ends(tmp_path) -> None:
    _fake_checkpoints(tmp_path, "sft_00000004", "sft_00000008")
    _prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft_00000008"]
