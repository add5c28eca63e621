"""The separate-placement keys are checked on load: each bad combination is refused before
any compute with one line that quotes the value and says what to do."""

from __future__ import annotations

import pytest

from reco_megatron.trainer.rollout_config import RolloutConfig
from tests.trainer.test_bad_config import _refused


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.max_staleness=1"], "rollout.max_staleness=1 with rollout.placement=colocated"),
        (["rollout.placement=separate"], "set loss.tis_cap (2.0 is the usual cap)"),
        (["rollout.placement=separate", "rollout.max_staleness=-1"], "got -1"),
        (
            ["rollout.placement=separate", "rollout.max_staleness=0",
             "rollout.bind_address=node7.cluster"],
            "rollout.bind_address must be 'auto' or an IP address of this node, got "
            "'node7.cluster'",
        ),
        (
            ["rollout.placement=separate", "rollout.max_staleness=0", "eval.interval=5"],
            "eval.interval=5 with rollout.placement=separate",
        ),
        (
            ["rollout.placement=separate", "rollout.max_staleness=0", "rollout.engine=megatron"],
            "rollout.placement=separate with rollout.engine=megatron",
        ),
        (
            ["rollout.placement=separate", "rollout.max_staleness=0", "rollout.worker_gpus=[0]",
             "rollout.num_workers=2"],
            "rollout.worker_gpus=[0]: give one GPU per spawned worker",
        ),
        (
            ["rollout.placement=separate", "rollout.max_staleness=0", "rollout.worker_gpus=[1,1]",
             "rollout.num_workers=2"],
            "names a GPU twice",
        ),
        (["rollout.num_workers=0"], "rollout.num_workers must be a positive integer, got 0"),
        (["rollout.worker_timeout_s=0"], "rollout.worker_timeout_s must be a number of seconds"),
        (["rollout.generate_timeout_s=-1"], "generate_timeout_s must be a number of seconds > 0"),
        (["rollout.placement=elsewhere"], "elsewhere"),
        (
            ["rollout.placement=separate", "rollout.max_staleness=0", "rollout.env=calculator",
             "rollout.generate_timeout_s=20", "rollout.env_step_timeout_s=30"],
            "rollout.generate_timeout_s=20.0 <= rollout.env_step_timeout_s=30.0 with "
            "rollout.env='calculator' and rollout.placement=separate",
        ),
    ],
)  # fmt: skip
def test_bad_placement_settings_are_refused(tmp_path, capsys, monkeypatch, overrides, expected):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert expected in _refused(tmp_path, capsys, overrides)


def test_the_staleness_bound_follows_the_placement() -> None:
    assert RolloutConfig().staleness_bound == 0
    assert RolloutConfig(placement="separate").staleness_bound == 1
    assert RolloutConfig(placement="separate", max_staleness=0).staleness_bound == 0
    assert RolloutConfig(placement="separate", max_staleness=3).staleness_bound == 3


def test_episodes_run_with_separate_placement() -> None:
    cfg = RolloutConfig(placement="separate", env="calculator", max_staleness=0)
    assert cfg.env == "calculator" and cfg.placement == "separate"
    with pytest.raises(ValueError, match=r"raise rollout\.generate_timeout_s well above"):
        RolloutConfig(placement="separate", env="calculator", generate_timeout_s=30.0)


def test_the_generation_watch_names_the_request_and_the_bound() -> None:
    from reco_megatron.rollout_worker import GenerationWatch

    watch = GenerationWatch(limit_s=30)
    assert watch.overdue() is None  # idle: nothing to overrun
    watch.begin(7)
    start = watch._busy[1]
    # not start + 30: (start + 30) - start rounds to just above 30 for some monotonic starts
    assert watch.overdue(now=start + 29.999) is None
    why = watch.overdue(now=start + 31)
    assert why is not None and "request 7 for 31 s" in why
    assert "rollout.generate_timeout_s=30" in why
    watch.end()
    assert watch.overdue(now=start + 1000) is None


def test_the_control_port_binds_loopback_or_this_node_never_every_interface() -> None:
    from reco_megatron.trainer.orchestration.workers import bind_address, this_host
    from reco_megatron.trainer.rollout_config import RolloutConfig

    def cfg(**kw) -> RolloutConfig:
        return RolloutConfig(placement="separate", max_staleness=0, **kw)

    assert bind_address(cfg()) == ("127.0.0.1", "127.0.0.1")  # spawned workers: this node
    assert bind_address(cfg(worker_launch="external")) == (this_host(), this_host())
    assert bind_address(cfg(bind_address="10.1.2.3")) == ("10.1.2.3", "10.1.2.3")
    assert bind_address(cfg(bind_address="0.0.0.0")) == ("0.0.0.0", this_host())  # named only
