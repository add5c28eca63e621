"""What the checkpoint checksums cost: hash throughput on a multi-GB file, and the share of a
real ``save_checkpoint`` spent hashing.

    python benchmarks/checkpoint_checksums.py --dir /work/tmp --file-gb 3 --hidden 1024 --layers 8

Part 1 writes ``--file-gb`` GB of random bytes (fsynced, as a checkpoint shard is), then reads
it back through crc32 (what the manifest records), sha256, blake2b and plain reads, from the
page cache (as right after a save). Part 2 saves the ReCo engine of a Llama-style model of the
given size on CPU (1 process, gloo) with :func:`save_checkpoint`, then times hashing the
saved files and :func:`verify_checkpoint` (the load-time check). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path


class _Crc:
    def __init__(self, fn):
        self.fn, self.value = fn, 0

    def update(self, data) -> None:
        self.value = self.fn(data, self.value)


def _throughput(path: Path, make) -> float:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    state = make()
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            state.update(view[:n])
    return path.stat().st_size / (time.perf_counter() - start) / 1e6


def file_part(directory: Path, gigabytes: float) -> dict:
    path = directory / "shard.bin"
    block = os.urandom(64 << 20)
    count = max(1, int(gigabytes * 1e9 / len(block)))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    size = path.stat().st_size
    rates = {
        "read_only": _throughput(path, lambda: _Crc(lambda d, v: v)),
        "crc32": _throughput(path, lambda: _Crc(zlib.crc32)),
        "sha256": _throughput(path, hashlib.sha256),
        "blake2b": _throughput(path, hashlib.blake2b),
    }
    path.unlink()
    crc_s = size / 1e6 / rates["crc32"]
    return {
        "file_bytes": size,
        "write_fsync_s": round(write_s, 2),
        "write_MBps": round(size / 1e6 / write_s),
        "hash_MBps": {k: round(v) for k, v in rates.items()},
        "crc32_s": round(crc_s, 2),
        "crc32_share_of_write": round(crc_s / write_s, 4),
    }


def _save_part(rank, world_size, root, hidden, layers):
    from reco_megatron.algo import LossConfig
    from reco_megatron.megatron.checkpoint import integrity, save_checkpoint, verify_checkpoint
    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.model.config import ModelConfig
    from reco_megatron.megatron.model.optimizer import OptimConfig
    from reco_megatron.megatron.step.config import UpdateConfig
    from reco_megatron.megatron.step.engine import ReCoEngine

    parallel = ParallelConfig(micro_batch_size=1)
    initialize_parallel(parallel, seed=0)
    model = ModelConfig(
        family="llama",
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=hidden * 3,
        num_attention_heads=max(hidden // 64, 1),
        num_query_groups=max(hidden // 256, 1),
        vocab_size=32000,
        max_position_embeddings=128,
    )
    engine = ReCoEngine(
        model,
        parallel,
        LossConfig.preset("reco", kl_coef=0.0),
        OptimConfig(),
        UpdateConfig(minibatches_per_rollout=2, stats_implementation="eager"),
        total_optimizer_steps=10,
    )
    start = time.perf_counter()
    final = save_checkpoint(root, 1, engine, {"step": 1})
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    integrity.hash_owned(final, 0, 1, fsync=False)
    hash_s = time.perf_counter() - start
    start = time.perf_counter()
    verify_checkpoint(final)
    verify_s = time.perf_counter() - start
    size = integrity.directory_size(final)
    model = engine.unwrapped()
    chunks = model if isinstance(model, list) else [model]
    return {
        "params": sum(p.numel() for chunk in chunks for p in chunk.parameters()),
        "checkpoint_bytes": size,
        "save_s (incl. checksums + fsync)": round(save_s, 2),
        "crc32_of_saved_files_s": round(hash_s, 2),
        "crc32_share_of_save": round(hash_s / save_s, 4),
        "verify_on_load_s": round(verify_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (a disk)")
    parser.add_argument("--file-gb", type=float, default=3.0)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    try:
        result = {"file": file_part(work, args.file_gb)}
        print(json.dumps(result, indent=1), flush=True)
        if args.layers > 0:
            from reco_megatron.testing import run_distributed

            result["save"] = run_distributed(
                _save_part, 1, args=(str(work / "ckpt"), args.hidden, args.layers), timeout=1800
            )[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
