"""The Triton kernels' CPU checks, run in a process that starts with ``TRITON_INTERPRET=1``.

Triton decides between compiling and interpreting when ``triton.language`` is first imported
(its reductions such as ``tl.max`` are themselves jitted functions), and megatron-core imports
Triton. So the interpreter must be on before *any* import of torch-side libraries: the test
module starts ``python -c "...main(path)"`` with the variable set, and this module runs every
check there (ranks forked over gloo by ``run_distributed``, whose fork server inherits the
variable) and pickles the per-rank results to ``path`` for the test module to compare with the
fp64 reference. The pytest process itself never sees the variable.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.parallel._hostile import hostile_body
from tests.parallel._vocab_cases import CASES, Case, global_inputs

TEST_BLOCKS = (32, 64)
"""Forward sub-rows per tile (32 x 4 fp32 or 32 x 8 bf16 columns, two tiles per iteration) and
backward tile width in these checks: several unmasked iterations, a masked last one and
padding per shard (the interpreter runs each tile in Python)."""
ALL = (True, True, True)
HOSTILE_TPS = (1, 2, 4)
"""-inf logits and an expanded input (``_hostile.py``) at these TP sizes."""


@dataclass(frozen=True)
class Spec:
    """One interpreted check: the op at TP ``tp`` on ``case``, gradient of the used outputs."""

    name: str
    case: Case
    tp: int
    dtype: torch.dtype = torch.float32
    use: tuple[bool, bool, bool] = ALL
    inplace: bool = False


SPECS = [
    *(Spec(f"fp32-{c.name}-tp{tp}", c, tp) for c in CASES for tp in (1, 2)),
    *(
        Spec(f"{n}-{'inplace' if ip else 'copy'}", CASES[1], 2, dt, inplace=ip)
        for n, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))
        for ip in (False, True)
    ),
    *(
        Spec(f"use-{n}", CASES[3], 2, use=u, inplace=True)
        for n, u in (
            ("logprob", (True, False, False)),
            ("entropy", (False, True, False)),
            ("sum_p2", (False, False, True)),
            ("logprob_sum_p2", (True, False, True)),
        )
    ),
    # vocab 129 padded to 512 over 4 ranks: rank 1 holds one real column, ranks 2-3 none.
    Spec("all-padding-shards-tp4", CASES[2], 4, inplace=True),
]


def body(rank: int, world_size: int, spec: Spec, device: str, blocks: tuple[int, int] | None):
    """The op on this rank's shard; returns (statistics, gradient of the shard) on CPU."""
    from reco_megatron.parallel import vocab_parallel_stats, vocab_stats_triton

    if blocks is not None:
        vocab_stats_triton.FORWARD_ROWS, vocab_stats_triton.BACKWARD_BLOCK = blocks
    logits, target, grads = global_inputs(spec.case, world_size)
    v_local = logits.shape[1] // world_size
    shard = logits[:, rank * v_local : (rank + 1) * v_local].to(spec.dtype).to(device)
    leaf = shard.clone().requires_grad_()
    output = leaf * 1  # a non-leaf, like the output layer's logits
    seen: dict[str, torch.Tensor] = {}
    output.register_hook(lambda g: seen.setdefault("grad", g))
    version = output._version
    group = dist.group.WORLD if world_size > 1 else None
    stats = vocab_parallel_stats(
        output,
        target.to(device),
        spec.case.vocab,
        group,
        implementation="triton",
        inplace_backward=spec.inplace,
    )
    used = [(o, g) for o, g, u in zip(stats, grads, spec.use, strict=True) if u]
    sum((o.double() * g.to(device)).sum() for o, g in used).backward()
    if spec.inplace:  # the gradient went into the logits buffer, and autograd was told
        assert seen["grad"].data_ptr() == output.data_ptr(), "gradient not written in place"
        assert output._version > version, "in-place write not recorded in the version counter"
    else:
        assert torch.equal(output.detach(), shard), "the op modified its input logits"
    return [s.detach().double().cpu() for s in stats], leaf.grad.double().cpu()


LINEAR_SPECS = [(2, False, torch.float32), (2, True, torch.float32), (1, False, torch.bfloat16)]
"""Fused output layer checks: (TP, sequence parallel, dtype)."""


def linear_body(rank: int, world_size: int, sequence_parallel: bool, dtype: torch.dtype):
    """The fused layers (statistics, 4 matmuls; loss inside, 3 matmuls) with the Triton
    kernels and with the eager math, same inputs."""
    from reco_megatron.parallel import vocab_stats_triton
    from reco_megatron.parallel.linear_loss import vocab_parallel_linear_loss
    from reco_megatron.parallel.linear_stats import vocab_parallel_linear_stats

    vocab_stats_triton.FORWARD_ROWS, vocab_stats_triton.BACKWARD_BLOCK = TEST_BLOCKS
    gen = torch.Generator().manual_seed(5)
    seq, batch, hidden_size, vocab = 6, 2, 8, 250
    v_pad = 256
    hidden = torch.randn(seq, batch, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(v_pad, hidden_size, generator=gen) * 0.5).to(dtype)
    target = torch.randint(0, vocab, (seq, batch), generator=gen)
    target[::4, 1] = -1
    upstream = [torch.randn(seq, batch, generator=gen) for _ in range(3)]
    rows = v_pad // world_size
    w_shard = weight[rank * rows : (rank + 1) * rows]
    s_local = seq // world_size
    h_local = hidden[rank * s_local : (rank + 1) * s_local] if sequence_parallel else hidden
    group = dist.group.WORLD if world_size > 1 else None
    out = {}
    for impl in ("triton", "eager"):
        h = h_local.clone().requires_grad_()
        w = w_shard.clone().requires_grad_()
        stats = vocab_parallel_linear_stats(
            h, w, target, vocab, group, sequence_parallel, block_tokens=5, implementation=impl
        )
        sum((s * g).sum() for s, g in zip(stats, upstream, strict=True)).backward()
        out[impl] = ([s.detach().double() for s in stats], h.grad.double(), w.grad.double())
        h = h_local.clone().requires_grad_()
        w = w_shard.clone().requires_grad_()
        loss, stats = vocab_parallel_linear_loss(
            h,
            w,
            target,
            lambda st: sum((s * g.view(-1)).sum() for s, g in zip(st, upstream, strict=True)),
            vocab,
            group,
            sequence_parallel,
            block_tokens=5,
            implementation=impl,
        )
        loss.backward()
        out[f"loss-{impl}"] = ([s.double() for s in stats], h.grad.double(), w.grad.double())
    return out


def triton_hostile_body(rank: int, world_size: int):
    from reco_megatron.parallel import vocab_stats_triton

    vocab_stats_triton.FORWARD_ROWS, vocab_stats_triton.BACKWARD_BLOCK = TEST_BLOCKS
    return hostile_body(rank, world_size, "triton")


def launches_body(rank: int, world_size: int):
    """Launches, collectives and host synchronisations of one forward + backward."""
    from reco_megatron.testing.launches import count_stats_op

    return count_stats_op(rank, world_size, "triton")


def main(path: str) -> None:
    """Run every spec under the interpreter; pickle ``{name: results or traceback}``."""
    from reco_megatron.testing import run_distributed

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("start this with TRITON_INTERPRET=1 in the environment")
    out: dict[str, object] = {}
    for spec in SPECS:
        try:
            out[spec.name] = run_distributed(
                body, spec.tp, args=(spec, "cpu", TEST_BLOCKS), timeout=300
            )
        except Exception:
            out[spec.name] = traceback.format_exc()
    for tp in HOSTILE_TPS:
        try:
            out[f"hostile-tp{tp}"] = run_distributed(triton_hostile_body, tp, timeout=300)
        except Exception:
            out[f"hostile-tp{tp}"] = traceback.format_exc()
    for tp in (1, 2):
        try:
            out[f"launches-tp{tp}"] = run_distributed(launches_body, tp, timeout=300)[0]
        except Exception:
            out[f"launches-tp{tp}"] = traceback.format_exc()
    for tp, sp, dtype in LINEAR_SPECS:
        name = f"linear-tp{tp}-{'sp' if sp else 'nosp'}-{str(dtype).removeprefix('torch.')}"
        try:
            out[name] = run_distributed(linear_body, tp, args=(sp, dtype), timeout=300)
        except Exception:
            out[name] = traceback.format_exc()
    with open(path, "wb") as f:
        pickle.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
