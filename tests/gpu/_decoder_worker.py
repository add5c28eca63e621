"""The megatron decoder on CUDA, with and without CUDA graphs, in a fresh process.

``python -m tests.gpu._decoder_worker OUT``: builds the tiny engine model on the GPU with the
reference test's seeded weights (``tests/megatron/_decoder_reference.py``), decodes the
reference prompts and settings with captured decode steps and again eagerly, and saves both
outputs, the number of graphs captured and the time of the timed call of each to OUT.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def main(out: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as on the CPU
    torch.backends.cudnn.allow_tf32 = False
    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
    from tests.megatron import _decoder_reference as ref
    from tests.megatron import _reco

    engine = _reco.build_engine()
    if engine.device.type != "cuda":
        raise SystemExit(f"the engine runs on {engine.device}, not on CUDA")
    _reco.load_full(engine, ref.seeded_weights(_reco.full_params(engine)))
    result = {}
    for graphs in (True, False):
        decoder = MegatronDecoder(
            engine.unwrapped(),
            vocab_size=engine.model_cfg.vocab_size,
            max_model_len=engine.model_cfg.max_position_embeddings,
            cuda_graphs=graphs,
        )
        rollout = MegatronEngine(decoder, MegatronEngineConfig(seed=0))
        ref.outputs(engine, rollout)  # warm-up: the first call of a shape captures
        torch.cuda.synchronize()
        start = time.perf_counter()
        got = ref.outputs(engine, rollout)
        torch.cuda.synchronize()
        result["graphs" if graphs else "eager"] = {
            "outputs": got,
            "captures": decoder.graphs.captures,
            "seconds": time.perf_counter() - start,
        }
    torch.save(result, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
