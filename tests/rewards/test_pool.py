"""RewardPool isolation: hangs are killed, memory is capped, crashes are replaced.

Workers are fresh interpreters (~0.1-0.6 s to start), so each test builds one small pool.
"""

from __future__ import annotations

import time

import pytest

from reco_megatron.rewards.pool import RewardPool
from reco_megatron.rewards.pool_config import RewardPoolConfig
from reco_megatron.rewards.registry import RewardSpecError

H = "tests.rewards._helpers"


def _pool(fn: str, **kwargs: object) -> RewardPool:
    defaults: dict = {"num_workers": 2, "timeout_s": 3.0, "memory_limit_mb": 1024}
    defaults.update(kwargs)
    return RewardPool(RewardPoolConfig(reward=f"{H}:{fn}", **defaults))


def test_hanging_item_is_timed_out_and_the_pool_keeps_working() -> None:
    with _pool("hang_on_hang", timeout_s=1.0) as pool:
        start = time.monotonic()
        batch = pool.score(["a", "hang", "b", "c", "hang"], ["a", "a", "b", "x", "a"])
        elapsed = time.monotonic() - start
        assert batch.scores == [1.0, 0.0, 1.0, 0.0, 0.0]
        assert batch.statuses == ["ok", "timeout", "ok", "ok", "timeout"]
        assert batch.metrics["reward/timeouts/sum"] == 2.0
        assert batch.metrics["reward/worker_restarts/sum"] == 2.0
        assert elapsed < 8.0, f"two 1 s timeouts on 2 workers took {elapsed:.1f} s"
        again = pool.score(["z"], ["z"])  # the replacements work
        assert again.scores == [1.0]
        assert again.metrics["reward/timeouts/sum"] == 0.0


def test_memory_hog_hits_the_limit_and_scores_zero() -> None:
    with _pool("hog_on_hog", memory_limit_mb=512) as pool:
        batch = pool.score(["hog", "a"], ["a", "a"])
        assert batch.scores == [0.0, 1.0]
        assert batch.statuses[0] == "memory"
        assert batch.metrics["reward/memory_errors/sum"] == 1.0
        assert pool.score(["hog", "b"], ["x", "b"]).scores == [0.0, 1.0]


def test_crashing_worker_is_replaced() -> None:
    with _pool("die_on_die") as pool:
        batch = pool.score(["die", "a", "die", "b"], ["a", "a", "a", "b"])
        assert batch.scores == [0.0, 1.0, 0.0, 1.0]
        assert batch.metrics["reward/crashes/sum"] == 2.0
        assert batch.metrics["reward/worker_restarts/sum"] == 2.0


def test_exceptions_and_invalid_returns_score_zero() -> None:
    with _pool("raise_on_raise", num_workers=1) as pool:
        batch = pool.score(["raise", "a"], ["a", "a"])
        assert (batch.scores, batch.statuses) == ([0.0, 1.0], ["error", "ok"])
        assert batch.metrics["reward/errors/sum"] == 1.0
    with _pool("returns_nan_or_result", num_workers=1) as pool:
        batch = pool.score(["nan", "x"], ["a", "a"])
        assert (batch.scores, batch.statuses) == ([0.0, 0.5], ["nan", "no_answer"])


def test_math_pool_with_huge_empty_and_adversarial_responses() -> None:
    cfg = RewardPoolConfig(reward="math", num_workers=2, timeout_s=10.0, max_response_chars=1000)
    responses = [
        r"so \boxed{\frac{1}{2}}",
        "",
        "junk " * 100_000 + r"\boxed{3}",  # cut to its tail: still found
        r"\boxed{" + "(" * 500 + "}",
        "\x00\udcff" + r"\boxed{{{{",
        None,
        "The answer is 7",
    ]
    golds = ["0.5", "1", "3", "1", "1", "1", "8"]
    with RewardPool(cfg) as pool:
        batch = pool.score(responses, golds)  # type: ignore[arg-type]
    assert batch.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert batch.metrics["reward/truncated/sum"] == 1.0
    assert batch.metrics["reward/no_answer/sum"] >= 1.0
    assert batch.metrics["reward/parse_failures/sum"] >= 1.0  # None response
    assert batch.metrics["reward/items/sum"] == 7.0


def test_self_check_rejects_a_non_numeric_reward() -> None:
    with pytest.raises(RewardSpecError, match="returned a non-number"):
        _pool("returns_string", num_workers=1)


def test_bad_spec_fails_before_starting_workers() -> None:
    with pytest.raises(RewardSpecError, match="cannot be imported"):
        RewardPool(RewardPoolConfig(reward="no.such.module:fn"))


def test_config_validation_and_length_mismatch() -> None:
    with pytest.raises(ValueError, match="timeout_s=0"):
        RewardPoolConfig(timeout_s=0)
    with _pool("exact", num_workers=1) as pool:
        with pytest.raises(ValueError, match="2 responses but 1 golds"):
            pool.score(["a", "b"], ["a"])
        assert pool.score([], []).scores == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["a"], ["a"])
