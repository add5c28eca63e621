"""Checkpoints of the ReCo engine: exact resume, resharding, and clear errors.

Resume is compared *bit for bit*: the same ranks run the same ops on restored state, so the
step after a load must equal the step of the uninterrupted run exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reco_megatron.megatron.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from reco_megatron.testing import run_distributed
from tests.megatron import _reco

pytestmark = pytest.mark.dist


def _reference(rank, world_size):
    return _reco.full_params(_reco.build_engine())


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return run_distributed(_reference, 1, timeout=120)[0]


def _update(engine, seed):
    batch = _reco.dp_share(_reco.rollout_batch(seed=seed))
    prepared, _ = engine.prepare(batch)
    return engine.train_on_rollout(prepared)


def _resume_body(rank, world_size, tp, root, reference):
    engine = _reco.build_engine(tp=tp)
    _reco.load_full(engine, reference)
    _update(engine, seed=1)
    save_checkpoint(root, 1, engine, {"step": 1, "data_position": 7}, keep_last=2)
    after_save = torch.rand(3)
    _update(engine, seed=2)
    uninterrupted = _reco.full_params(engine)

    fresh = _reco.build_engine(tp=tp)  # new random weights and optimizer: the load overwrites
    state = load_checkpoint(latest_checkpoint(root), fresh)
    after_load = torch.rand(3)
    _update(fresh, seed=2)
    return {
        "state": state,
        "rng_equal": torch.equal(after_save, after_load),
        "uninterrupted": uninterrupted,
        "resumed": _reco.full_params(fresh),
        "steps": (engine.optimizer_steps, fresh.optimizer_steps),
    }


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 1)], ids=["dp2", "tp2"])
def test_resume_equals_uninterrupted(tp, dp, reference, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    for res in run_distributed(_resume_body, tp * dp, args=(tp, root, reference), timeout=180):
        assert res["state"] == {"step": 1, "data_position": 7}
        assert res["rng_equal"], "RNG state not restored"
        assert res["steps"][0] == res["steps"][1]
        for name, value in res["uninterrupted"].items():
            assert torch.equal(res["resumed"][name], value), name
    assert (Path(root) / "latest").read_text().strip() == "step_00000001"


def _save_body(rank, world_size, tp, root, reference):
    engine = _reco.build_engine(tp=tp)
    _reco.load_full(engine, reference)
    _update(engine, seed=1)
    save_checkpoint(root, 5, engine, {"step": 5})
    return _reco.full_params(engine)


def _load_weights_body(rank, world_size, tp, root, **kwargs):
    engine = _reco.build_engine(tp=tp, **kwargs)
    load_checkpoint(latest_checkpoint(root), engine, load_optimizer=False, load_rng=False)
    return _reco.full_params(engine)


def test_tp2_checkpoint_loads_at_tp1(reference, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_distributed(_save_body, 2, args=(2, root, reference), timeout=180)[0]
    loaded = run_distributed(_load_weights_body, 1, args=(1, root), timeout=120)[0]
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def _retention_body(rank, world_size, root, reference):
    engine = _reco.build_engine()
    _reco.load_full(engine, reference)
    kept = []
    for step in (0, 3, 4, 5):
        save_checkpoint(root, step, engine, {"step": step}, keep_last=2)
        kept.append(sorted(p.name for p in Path(root).iterdir() if p.name != "latest"))
    return kept


def test_retention_and_crash_leftovers(reference, tmp_path) -> None:
    root = tmp_path / "ckpt"
    kept = run_distributed(_retention_body, 1, args=(str(root), reference), timeout=180)[0]
    # keep_last=2 keeps the two newest, never step 0 (the warm-up's end), and nothing else
    steps = [f"step_0000000{s}" for s in (0, 3, 4, 5)]
    assert kept == [steps[:1], steps[:2], steps[:3], [steps[0], *steps[2:]]]
    # A crash mid-save leaves a .tmp directory: it is never taken for a checkpoint.
    (root / ".tmp-step_00000009" / "dist").mkdir(parents=True)
    assert latest_checkpoint(root) == root / "step_00000005"
    assert read_meta(root / "step_00000005")["layout"]["tensor_model_parallel_size"] == 1


def _expect_error(rank, world_size, root, mode):
    kwargs = {"model": _reco.model_config(hidden_size=64)} if mode == "other_model" else {}
    engine = _reco.build_engine(**kwargs)
    path = Path(root) / "step_00000005"
    try:
        load_checkpoint(path, engine, load_optimizer=mode != "other_model")
    except CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("missing", "no meta.json"),
        ("corrupt_meta", "meta.json: size 9 bytes"),
        ("corrupt_weights", "is damaged"),
        # written before checksums (no manifest): the readers' own errors still name the cause
        ("corrupt_meta/old", "corrupted"),
        ("corrupt_weights/old", "could not read the weights"),
        ("other_model", "model.hidden_size: checkpoint 32 vs config 64"),
        ("other_dp", "data-parallel size: checkpoint 2 vs run 1"),
    ],
)
def test_bad_checkpoints_give_clear_errors(mode, match, reference, tmp_path) -> None:
    root = tmp_path / "ckpt"
    if mode == "other_dp":
        run_distributed(_save_dp2_body, 2, args=(str(root), reference), timeout=180)
    elif mode != "missing":
        run_distributed(_save_body, 1, args=(1, str(root), reference), timeout=120)
    step = root / "step_00000005"
    if mode.endswith("/old"):  # format 1, written before checksums: no manifest
        _as_format_1(step)
    if mode.startswith("corrupt_meta"):
        (step / "meta.json").write_text("{not json")
    if mode.startswith("corrupt_weights"):
        for f in (step / "dist").rglob("*.distcp"):
            f.write_bytes(b"\0" * 16)
    message = run_distributed(_expect_error, 1, args=(str(root), mode), timeout=120)[0]
    assert message is not None and match in message, message


def _as_format_1(step: Path) -> None:
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    (step / "manifest.json").unlink()


def _save_dp2_body(rank, world_size, root, reference):
    engine = _reco.build_engine()
    _reco.load_full(engine, reference)
    save_checkpoint(root, 5, engine, {"step": 5})


def test_latest_pointer_to_a_removed_checkpoint(tmp_path) -> None:
    (tmp_path / "latest").write_text("step_00000003\n")
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "nothing") is None
