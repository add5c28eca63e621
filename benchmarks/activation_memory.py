"""Benchmark: the activation memory of one transformer layer, measured on CPU, against the
scaling law ``megatron/memory/estimate.py`` assumes.

The estimate (Korthikanti et al. 2022, SwiGLU/GQA, flash attention, no recomputation) keeps
``s * b * (10 h + 4 kv + 6 F) / TP`` bytes per layer in bf16 with sequence parallelism, i.e.
``(5 h + 2 kv + 3 F) / TP`` elements per token, independent of the dtype. What a CPU can
check is that law's shape: this script counts the elements autograd saves for the backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters excluded) in a
real forward of megatron's ``GPTModel`` (the local spec the CPU runs), per layer (2 layers
minus 1) and per token, and splits it into a part linear in the sequence length and one
quadratic in it by measuring at two lengths. The quadratic part is the local attention's
``[b, heads, s, s]`` scores and probabilities; flash attention (the GPU path) keeps only
``O(s)`` of it, which is why the law has no such term. Layouts: TP 1, TP 2, TP 2 + SP, each
with megatron's local attention (``model.attention_backend=local``) and torch's fused one
(``torch``, the default without transformer-engine).

The second table (``--lengths``) follows one layer's saved elements per token from s = 256 up
to 4096 with ``local`` (its ``[b, heads, s, s]`` scores: 0.5 GiB per fp32 tensor per layer at
4096 with 8 heads) and to 16384 with ``torch``: constant per token (linear memory) with
``torch``, growing with s (quadratic) with ``local``.

Run::

    python benchmarks/activation_memory.py        # first table, ~1 min on 2 cores
    python benchmarks/activation_memory.py --lengths --json out.json   # both, a few minutes
"""

from __future__ import annotations

import argparse
import json

import torch

from reco_megatron.testing import run_distributed

ARCH = dict(hidden_size=64, ffn_hidden_size=176, num_attention_heads=8, num_query_groups=2)
LENGTHS = (64, 128)
BATCH = 2


def _saved_elements(model, tokens, positions) -> tuple[int, dict[str, int]]:
    """Elements autograd saves in one forward (each storage once, parameters excluded), in
    all and per module (the innermost module running when the tensor was saved)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    stack = ["(model)"]
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
        handles.append(module.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1]))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (stack[-1], storage.nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, positions, None)
    del out
    for handle in handles:
        handle.remove()
    by_module: dict[str, int] = {}
    for name, n in seen.values():
        by_module[name] = by_module.get(name, 0) + n
    return sum(n for _, n in seen.values()), by_module


def _body(rank, world_size, tp, sp, attention="local", lengths=LENGTHS, batch=BATCH):
    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.model.build import build_model, transformer_config
    from reco_megatron.megatron.model.config import ModelConfig

    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    initialize_parallel(parallel, seed=0)
    counts, modules = {}, {}
    for layers in (1, 2):
        cfg = ModelConfig(
            num_layers=layers,
            vocab_size=128,
            max_position_embeddings=max(lengths),
            attention_backend=attention,
            **ARCH,
        )
        model = build_model(
            cfg,
            transformer_config(cfg, parallel, False),
            pre_process=True,
            post_process=True,
            on_gpu=False,
        )
        for s in lengths:
            tokens = torch.randint(0, 128, (batch, s))
            positions = torch.arange(s).expand(batch, s)
            counts[(layers, s)], modules[(layers, s)] = _saved_elements(model, tokens, positions)
        del model
    per_layer = {s: counts[(2, s)] - counts[(1, s)] for s in lengths}
    if lengths != LENGTHS:
        return {"per_layer": per_layer, "batch": batch}
    (s1, s2) = LENGTHS
    # per_layer(s) = b (a s + q s^2): solve for the linear (a) and quadratic (q) coefficients
    q = (per_layer[s2] / s2 - per_layer[s1] / s1) / (BATCH * (s2 - s1))
    a = per_layer[s1] / (BATCH * s1) - q * s1
    layer0 = {
        k.removeprefix("decoder.layers.0."): v / (BATCH * s1)
        for k, v in modules[(1, s1)].items()
        if k.startswith("decoder.layers.0.")
    }
    return {"linear_per_token": a, "quadratic_per_token_per_s": q, "layer0": layer0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", action="store_true", help="also the table over s")
    parser.add_argument("--json", help="write the raw counts here")
    args = parser.parse_args()
    raw: dict = {"arch": ARCH}
    h, f = ARCH["hidden_size"], ARCH["ffn_hidden_size"]
    kv = ARCH["num_query_groups"] * h // ARCH["num_attention_heads"]
    law = (5 * h + 2 * kv + 3 * f) / 1
    print(f"h={h}, kv={kv}, F={f}, b={BATCH}, s in {LENGTHS}; law (5h+2kv+3F)/TP = {law:.0f}/TP")
    print(
        "| layout | attention | linear part, elements per token per layer | law | "
        "measured / law | quadratic part, per token per unit of s |"
    )
    print("|---|---|---|---|---|---|")
    breakdown = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        for attention in ("local", "torch"):
            got = run_distributed(_body, tp, args=(tp, sp, attention), timeout=600)[0]
            name = f"TP {tp}" + (" + SP" if sp else "")
            lin, quad = got["linear_per_token"], got["quadratic_per_token_per_s"]
            raw[f"{name} {attention}"] = got
            print(
                f"| {name} | {attention} | {lin:.0f} | {law / tp:.0f} | "
                f"{lin / (law / tp):.2f} | {quad:.2f} |"
            )
            breakdown.setdefault(attention, got["layer0"])
    for attention, parts in breakdown.items():
        print(f"\nTP 1, {attention} attention, one layer, s = {LENGTHS[0]}: elements per token")
        print("| module | elements per token |\n|---|---|")
        for name, n in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {n:.0f} |")
    if args.lengths:
        raw["lengths"] = _lengths_table()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=1, default=str)


def _lengths_table() -> dict:
    """Saved elements of one layer over s (TP 1, batch 1), local vs torch attention."""
    runs = {"local": (256, 1024, 4096), "torch": (256, 1024, 4096, 16384)}
    got = {
        name: run_distributed(_body, 1, args=(1, False, name, s, 1), timeout=1200)[0]["per_layer"]
        for name, s in runs.items()
    }
    print("\nTP 1, batch 1: elements autograd saves for one layer, per token")
    print("| s | local | torch | local / torch |\n|---|---|---|---|")
    for s in runs["torch"]:
        torch_tok = got["torch"][s] / s
        local = got["local"].get(s)
        cells = (f"{local / s:.0f}", f"{local / got['torch'][s]:.1f}") if local else ("-", "-")
        print(f"| {s} | {cells[0]} | {torch_tok:.0f} | {cells[1]} |")
    return got


if __name__ == "__main__":
    main()
