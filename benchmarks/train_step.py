"""Benchmark: one ReCo rollout update of a small Llama-style model on CPU, per phase.

Phases, as the engine reports them: the old-policy pass (forward-only over the rollout
batch), forward+backward of each mini-batch, and the optimizer step; plus the loss layer alone
(``vocab_parallel_stats`` + ``policy_loss``, forward+backward, on logits of the model's output
shape) to give its share of the forward+backward. TP 1 and TP 2 run side by side in one
invocation (ranks forked locally over gloo, one thread each), medians over ``--reps`` updates
after a warm-up.

Run::

    python benchmarks/train_step.py                 # TP 1 and 2, markdown table
    python benchmarks/train_step.py --tp 1 --reps 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from reco_megatron.testing import run_distributed

ARCH = dict(
    family="llama",
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=688,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=32000,
    max_position_embeddings=512,
)
GROUPS, GROUP_SIZE, LENGTH, MICRO = 4, 4, 257, 4


def _batch(vocab: int):
    from reco_megatron.parallel.batch import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    b = GROUPS * GROUP_SIZE
    tokens = torch.randint(0, vocab, (b, LENGTH), generator=gen)
    mask = torch.zeros(b, LENGTH)
    mask[:, 64:] = 1.0
    return RolloutBatch(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.randn(b, generator=gen),
        group_size=GROUP_SIZE,
    )


def _body(rank, world_size, reps):
    from megatron.core import parallel_state as ps

    from reco_megatron.algo import LossConfig, policy_loss
    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.model.config import ModelConfig
    from reco_megatron.megatron.model.optimizer import OptimConfig
    from reco_megatron.megatron.step.config import UpdateConfig
    from reco_megatron.megatron.step.engine import ReCoEngine
    from reco_megatron.parallel import vocab_parallel_stats

    parallel = ParallelConfig(tensor_model_parallel_size=world_size, micro_batch_size=MICRO)
    initialize_parallel(parallel, seed=0)
    model = ModelConfig(**ARCH)
    loss_cfg = LossConfig.preset("reco", kl_coef=0.0)
    engine = ReCoEngine(
        model,
        parallel,
        loss_cfg,
        OptimConfig(lr=1e-5),
        UpdateConfig(minibatches_per_rollout=2, stats_implementation="eager"),
        total_optimizer_steps=100,
    )
    batch = _batch(model.vocab_size)
    phases: dict[str, list[float]] = {"old_policy": [], "fwd_bwd": [], "optimizer": [], "loss": []}
    v_local = model.padded_vocab_size(world_size) // world_size
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        prepared, prep = engine.prepare(batch)
        steps = engine.train_on_rollout(prepared)
        total = time.perf_counter() - t0
        # The loss layer alone on one micro-batch's logits shape.
        logits = torch.randn(MICRO, LENGTH - 1, v_local, requires_grad=True)
        mb = prepared.select(slice(0, MICRO))
        t1 = time.perf_counter()
        stats = vocab_parallel_stats(
            logits,
            mb.labels,
            model.vocab_size,
            tp_group=ps.get_tensor_model_parallel_group(),
            implementation="eager",
        )
        loss, _ = policy_loss(
            stats.logprob,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            loss_cfg,
            weights=mb.weights,
        )
        loss.backward()
        loss_time = time.perf_counter() - t1
        if rep == 0:
            continue  # warm-up
        phases["old_policy"].append(prep["time_old_logprob"])
        phases["fwd_bwd"].append(sum(s["time_forward_backward"] for s in steps))
        phases["optimizer"].append(sum(s["time_optimizer"] for s in steps))
        # Micro-batches per update: every mini-batch's micro-batches, each through the loss.
        n_micro = batch.num_sequences // MICRO
        phases["loss"].append(loss_time * n_micro)
        phases.setdefault("total", []).append(total)
    return {k: statistics.median(v) for k, v in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows = [
        "| TP | update s | old-policy pass s | fwd+bwd s | optimizer s | loss layer s "
        "| loss layer / fwd+bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for tp in args.tp:
        r = run_distributed(_body, tp, args=(args.reps,), timeout=3000)
        t = {k: max(x[k] for x in r) for k in r[0]}
        rows.append(
            f"| {tp} | {t['total']:.2f} | {t['old_policy']:.2f} | {t['fwd_bwd']:.2f} | "
            f"{t['optimizer']:.2f} | {t['loss']:.2f} | {t['loss'] / t['fwd_bwd']:.2f} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
