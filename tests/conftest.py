"""Shared pytest setup: deterministic torch, CPU only."""

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The 8-rank layout rehearsals (marker ``layouts``, minutes each) run only when asked
    for: ``pytest -m layouts`` (any marker expression naming them) or RECO_TEST_LAYOUTS=1."""
    if "layouts" in (config.getoption("markexpr") or "") or os.environ.get("RECO_TEST_LAYOUTS"):
        return
    skip = pytest.mark.skip(
        reason="8-rank rehearsal of an example's layout (minutes): run `pytest -m layouts`"
    )
    for item in items:
        if item.get_closest_marker("layouts") is not None:
            item.add_marker(skip)
