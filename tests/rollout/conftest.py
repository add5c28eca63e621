"""Fixtures of the rollout tests: one tiny model, one engine holding its weights, the fake vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from reco_megatron.rollout import EmbeddedEngine
from tests.rollout import fake_vllm
from tests.rollout._tiny import TINY_LLAMA, tiny_model


@pytest.fixture(scope="module")
def ref_model():
    return tiny_model(seed=0)


@pytest.fixture
def engine(ref_model) -> EmbeddedEngine:
    eng = EmbeddedEngine(TINY_LLAMA)
    eng.update_weights(ref_model.state_dict().items())
    return eng


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The fake vLLM installed and a config-only model directory (``fake_vllm.prepare``)."""
    return fake_vllm.prepare(monkeypatch, tmp_path)
