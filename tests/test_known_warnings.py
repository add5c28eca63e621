"""Known third-party warnings become one line, once; other warnings one line through the
package logger (so a progress bar is never broken); the switch turns the notes off."""

from __future__ import annotations

import logging
import warnings

import pytest

from reco_megatron.utils import noise

SAMPLES = {
    "te-apex": "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "absl": "absl.logging is not installed. Using logging.getLogger(__name__) instead.",
    "no-cuda": "No CUDA runtime is found, using CUDA_HOME='/usr/local'",
    "mcore-deprecations": "full scope is deprecated. Use empty cuda_graph_modules",
    "mcore-async-save": "MCore's async save is deprecated and will be removed",
    "torch-collectives": "`torch.distributed.all_gather_into_tensor` is deprecated.",
    "vllm-reduce-op": "`torch.distributed.reduce_op` is deprecated, please use `ReduceOp`",
    "non-leaf-grad": "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "dcp-single-process": "torch.distributed is disabled, unavailable or uninitialized, assuming "
    "the intent is to load in a single process.",
    "cuda-max-connections": "When using sequence parallelism it is recommended to set the "
    "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
}


@pytest.fixture
def records(monkeypatch, caplog):
    """Fresh module state; the loggers the install touches are put back afterwards."""
    monkeypatch.setattr(noise, "_seen", set())
    monkeypatch.setattr(noise, "_state", {})
    monkeypatch.setattr(noise, "_pending", [])
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    megatron, cpp = logging.getLogger("megatron"), logging.getLogger("torch.utils.cpp_extension")
    saved = (list(megatron.handlers), megatron.propagate, list(cpp.filters))
    package = logging.getLogger("reco_megatron")
    package.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    package.removeHandler(caplog.handler)
    megatron.handlers[:], megatron.propagate, cpp.filters[:] = saved


def test_every_known_pattern_matches_its_sample() -> None:
    assert {key for key, _, _ in noise.KNOWN} == set(SAMPLES)
    for key, text in SAMPLES.items():
        assert noise.known(text)[0] == key
    assert noise.known("something else entirely") is None


def test_once_and_one_line(records) -> None:
    assert noise.quiet_known_warnings("once") == "once"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        noise.quiet_known_warnings("once")  # what reco-train does, inside the filter context
        for _ in range(3):
            warnings.warn(SAMPLES["te-apex"], UserWarning, stacklevel=1)
        warnings.warn("an unknown\nmulti-line warning", UserWarning, stacklevel=1)
    logging.getLogger("megatron.core.dist_checkpointing").warning(SAMPLES["mcore-async-save"])
    noise.release_notes()
    messages = [r.getMessage() for r in records.records]
    assert sum("transformer-engine / apex" in m for m in messages) == 1
    assert sum("async-save" in m for m in messages) == 1
    # The raw record is dropped by the handler the package gives megatron's loggers (pytest
    # attaches its own capture handlers to non-propagating loggers, so ask the handler).
    ours = [
        h
        for h in logging.getLogger("megatron").handlers
        if any(isinstance(f, noise._KnownFilter) for f in h.filters)
    ]
    text = "MCore's async save is deprecated"
    raw = logging.LogRecord("megatron.core.x", logging.WARNING, __file__, 1, text, None, None)
    assert ours and not ours[-1].filter(raw)
    (unknown,) = [m for m in messages if "unknown" in m]
    assert unknown.endswith("UserWarning: an unknown") and "\n" not in unknown


def test_off_drops_the_notes(records) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        noise.quiet_known_warnings("off")
        warnings.warn(SAMPLES["absl"], UserWarning, stacklevel=1)
    assert not [r for r in records.records if "absl" in r.getMessage()]
    with pytest.raises(ValueError, match="RECO_KNOWN_WARNINGS must be once, off or all"):
        noise.quiet_known_warnings("loud")


def test_notes_wait_for_the_runs_own_first_line(records) -> None:
    """The notes come out just before the run's first line of its own; an error drops them
    (a configuration error is then the only thing printed)."""
    package = logging.getLogger("reco_megatron")
    ours = [
        h for h in package.handlers if any(isinstance(f, noise._ReleaseNotes) for f in h.filters)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        noise.quiet_known_warnings("once")
        assert ours, "the package handler releases the notes"
        warnings.warn(SAMPLES["te-apex"], UserWarning, stacklevel=1)
    assert not [r for r in records.records if "apex" in r.getMessage()]  # held
    logging.getLogger("reco_megatron.trainer.x").info("building the run")
    names = [r.getMessage() for r in records.records]
    assert names[-1] == "building the run" and "transformer-engine / apex" in names[-2]
    records.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn(SAMPLES["absl"], UserWarning, stacklevel=1)
    logging.getLogger("reco_megatron.evaluate").error("reco-eval: bad input")
    assert [r.getMessage() for r in records.records] == ["reco-eval: bad input"]
    assert noise._pending == []


def test_unknown_warning_source_without_site_packages() -> None:
    path = "/x/venv/lib/python3.12/site-packages/torch/distributed/checkpoint/utils.py"
    assert noise.short_source(path) == "torch/distributed/checkpoint/utils.py"
    assert noise.short_source("/work/repo/reco_megatron/x.py") == "/work/repo/reco_megatron/x.py"
