"""Today's megatron decoder against the first one's answers (``data/decoder_reference.json``).

The fixture was written by the decoder that ran megatron-core's static inference path
(``tests/megatron/_decoder_reference.py``, TP 1, chunks of 4 rows). The decoder that owns
attention and the KV cache must give the same tokens, finish reasons and (fp32, CPU) log-probs
within 1e-5 (both compute the same function; the summation order of attention differs) at every
layout, with every row of a call in one batch, and record the same experts for every position
the old one fed.
"""

from __future__ import annotations

import json

import pytest

from reco_megatron.testing import run_distributed
from tests.megatron import _decoder_reference as ref

pytestmark = pytest.mark.dist

TOL = 1e-5


def _compare(got: dict, want: dict) -> None:
    for name in ref.SETTINGS:
        assert len(got[name]) == len(want[name])
        for (gt, gl, gr), (wt, wl, wr) in zip(got[name], want[name], strict=True):
            assert gt == wt, f"{name}: tokens {gt} != reference {wt}"
            assert gr == wr, f"{name}: finish reason {gr} != {wr}"
            gap = max((abs(a - b) for a, b in zip(gl, wl, strict=True)), default=0.0)
            assert gap < TOL, f"{name}: log-prob gap {gap}"


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_dense_decoder_matches_the_reference(tp: int, pp: int) -> None:
    want = json.loads(ref.FIXTURE.read_text())["dense"]
    results = run_distributed(ref.dense_body, tp * pp, args=(tp, pp, None), timeout=300)
    for got in results:
        _compare(got, want)


def test_rows_moved_into_smaller_batches_decode_the_same() -> None:
    # a host read after every step: rows that stopped leave the batch at once and the live
    # rows (and their keys and values) move into batches of 8, 4, 2, 1 rows
    want = json.loads(ref.FIXTURE.read_text())["dense"]
    got = run_distributed(ref.dense_body, 1, args=(1, 1, None), kwargs={"sync_every": 1})[0]
    _compare(got, want)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_prefill_split_into_groups_of_rows_decodes_the_same(moe: bool) -> None:
    # long prompts prefill in groups of rows (bounded attention scores): one row per forward
    # here, with the routed experts of each group stored at its own rows
    want = json.loads(ref.FIXTURE.read_text())["moe" if moe else "dense"]
    got = run_distributed(ref.small_prefill_body, 1, args=(moe,), timeout=300)[0]
    _compare(got, want)
    if moe:
        for g, w in zip(got["routed"], want["routed"], strict=True):
            assert g[:-1] == w[:-1]


@pytest.mark.parametrize("ep", [1, 2], ids=["ep1", "ep2"])
def test_moe_decoder_matches_the_reference(ep: int) -> None:
    want = json.loads(ref.FIXTURE.read_text())["moe"]
    results = run_distributed(ref.moe_body, ep, args=(ep, None), timeout=300)
    for got in results:
        _compare(got, want)
        for g, w in zip(got["routed"], want["routed"], strict=True):
            assert len(g) == len(w)
            # every position but the last was fed by both decoders: the same experts; the last
            # token is fed only when the call went on after it (-1 where it was not)
            assert g[:-1] == w[:-1]
            missing = [[-1] * len(w[-1][0])] * len(w[-1])
            assert g[-1] == w[-1] or missing in (g[-1], w[-1])
