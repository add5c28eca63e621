"""The decode step's structure, counted on the CPU (counts, not times).

A decode step must cost the same at any context length: the same aten ops (kernels on a GPU),
a bounded number per layer, the same bytes written (a key is rotated and written once; nothing
of size ``context`` is copied or re-rotated per step), and no host read (``.item()``,
``.cpu()``, data-dependent shapes) inside the ``sync_every`` steps between two host reads.
Megatron-core's static inference path, which the decoder replaced, re-rotated every cached key
and copied K/V per query group at every step (bytes grew ~3x from context 20 to 60) and read
the sampled tokens back every step.
"""

from __future__ import annotations

import pytest

from reco_megatron.testing import run_distributed
from tests.megatron._decoder_structure import profile_body

pytestmark = pytest.mark.dist

OPS_PER_LAYER = 50
"""Bound on non-view aten ops per layer and decode step (measured 47 with megatron-core 0.19.2:
norms, projections, RoPE, the cache write, attention, MLP)."""
OPS_OUTSIDE_LAYERS = 90
"""Bound on the rest of a step (measured 70: embedding, final norm, logits, top-p sampling,
the state update)."""


@pytest.fixture(scope="module")
def profiles() -> dict[int, dict]:
    return {n: run_distributed(profile_body, 1, args=(n,), timeout=300)[0] for n in (2, 4)}


def test_a_decode_step_costs_the_same_at_any_context_length(profiles) -> None:
    steps = profiles[2]["steps"]
    assert profiles[2]["lengths"] == [70, 70, 70]
    assert len(steps) == 69  # one prefill, then one step per further token
    # step i feeds position 4 + i: context 20 vs 60
    ops20, bytes20, _ = steps[16]
    ops60, bytes60, _ = steps[56]
    assert ops60 == ops20
    assert bytes60 == bytes20
    assert len({s[0] for s in steps}) == 1 and len({s[1] for s in steps}) == 1


def test_a_decode_step_launches_a_bounded_number_of_ops_per_layer(profiles) -> None:
    two, four = profiles[2]["steps"][10][0], profiles[4]["steps"][10][0]
    per_layer = (four - two) / 2
    assert 0 < per_layer <= OPS_PER_LAYER, per_layer
    assert two - 2 * per_layer <= OPS_OUTSIDE_LAYERS


def test_no_host_read_inside_a_step_and_one_per_round(profiles) -> None:
    for n, profile in profiles.items():
        for i, (_, _, syncs) in enumerate(profile["steps"]):
            assert not syncs, f"{n} layers, step {i}: host reads {syncs}"
        assert profile["rounds"] == -(-69 // 8)  # 69 steps in rounds of sync_every = 8
