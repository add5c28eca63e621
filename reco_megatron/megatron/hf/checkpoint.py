"""Hugging Face checkpoint directories: save from and load into Megatron model chunks.

Saving (:func:`save_hf_checkpoint`, collective) streams: every pipeline stage exports its own
layers (:func:`reco_megatron.megatron.hf.convert.export_hf_weights`), global rank 0 receives
them one tensor at a time (:func:`gather_hf_weights`) and writes each straight into its
place in a ``.safetensors`` file whose header was computed beforehand from the export plan,
so rank 0 holds one full tensor beyond its model however large the checkpoint is. Files are
sharded at ``max_shard_size`` bytes with a ``model.safetensors.index.json``, written into a
temporary directory and renamed.

Loading (:func:`load_hf_checkpoint`) reads ``config.json`` (checked against the ModelConfig)
and only the tensors this rank's stage needs through ``safetensors.safe_open`` (no pickle),
then fuses, pads and shards them for the current TP/PP layout.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.hf.config import (
    architecture_mismatches,
    hf_config_from_model_config,
    model_config_from_hf,
)
from reco_megatron.megatron.hf.convert import (
    LM_HEAD,
    WeightMappingError,
    export_hf_weights,
    export_plan,
    hf_shapes,
    import_hf_weights,
)
from reco_megatron.megatron.hf.target import check_target, move_into_place
from reco_megatron.megatron.model.config import ModelConfig
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

Plan = list[tuple[str, tuple[int, ...], torch.dtype]]
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _pp() -> tuple[int, Any, list[int]]:
    from megatron.core import parallel_state as ps

    size = ps.get_pipeline_model_parallel_world_size()
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group) if dist.is_initialized() else [0]
    return size, group, ranks


# ------------------------------------------------------------------ gathering stages
def stage_plans(model_chunks: list[Any], model_cfg: ModelConfig) -> list[Plan]:
    """The export plan of every pipeline stage, in stage order (collective over PP)."""
    local = export_plan(model_chunks, model_cfg)
    size, group, _ = _pp()
    if size == 1:
        return [local]
    plans: list[Any] = [None] * size
    dist.all_gather_object(plans, local, group=group)
    return plans


def gather_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig, plans: list[Plan] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """All HF ``(name, tensor)`` pairs of the model, yielded on global rank 0 only.

    Collective: every rank must exhaust the iterator (others yield nothing). Stage 0's
    tensors come from rank 0 itself; stage ``s`` is sent point to point by the rank of stage
    ``s`` in rank 0's pipeline group, one tensor at a time, in the order of ``plans[s]``.
    """
    plans = plans if plans is not None else stage_plans(model_chunks, model_cfg)
    local = export_hf_weights(model_chunks, model_cfg)
    size, _, ranks = _pp()
    me = _rank()
    if me == 0:
        yield from local
        for stage in range(1, size):
            for name, shape, dtype in plans[stage]:
                buf = torch.empty(shape, dtype=dtype)
                dist.recv(buf, src=ranks[stage])
                yield name, buf
    elif size > 1 and 0 in ranks:
        for _, tensor in local:
            dist.send(tensor.detach().cpu().contiguous(), dst=0)
    else:
        for _ in local:
            pass


def all_stage_hf_weights(
    model_chunks: list[Any], model_cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF ``(name, tensor)`` pair of the model on *every* rank (collective over TP and
    PP): what a rollout engine per rank needs. TP shards are all-gathered by the export; each
    pipeline stage's tensors are broadcast over the pipeline group one at a time (peak: one
    full tensor beyond the model)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        yield from export_hf_weights(model_chunks, model_cfg)
        return
    plans = stage_plans(model_chunks, model_cfg)
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    me = ps.get_pipeline_model_parallel_rank()
    local = export_hf_weights(model_chunks, model_cfg)
    for stage in range(pp):
        for name, shape, dtype in plans[stage]:
            if stage == me:
                got_name, tensor = next(local)
                if got_name != name:
                    raise RuntimeError(f"export order changed: expected {name}, got {got_name}")
                buf = tensor.detach().contiguous().clone()
            else:
                buf = torch.empty(shape, dtype=dtype, device=_broadcast_device())
            dist.broadcast(buf, src=ranks[stage], group=group)
            yield name, buf
    for _ in local:  # exhaust (collectives inside the export generator)
        pass


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


def _broadcast_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ streamed safetensors
def _split_shards(plan: Plan, max_bytes: int) -> list[Plan]:
    shards: list[Plan] = [[]]
    size = 0
    for item in plan:
        nbytes = _nbytes(item)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _nbytes(item: tuple[str, tuple[int, ...], torch.dtype]) -> int:
    numel = 1
    for s in item[1]:
        numel *= s
    return numel * torch.empty((), dtype=item[2]).element_size()


def _header(shard: Plan) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in shard:
        name, shape, dtype = item
        if dtype not in _ST_DTYPES:
            raise WeightMappingError(f"{name}: dtype {dtype} cannot be written to safetensors")
        end = offset + _nbytes(item)
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors_stream(
    out_dir: Path, plan: Plan, tensors: Iterator[tuple[str, torch.Tensor]], max_shard_size: int
) -> list[str]:
    """Write ``tensors`` (arriving in ``plan`` order) into sharded safetensors files.

    Each tensor is written as it arrives and then dropped. Returns the file names; writes
    ``model.safetensors.index.json`` when there is more than one.
    """
    shards = _split_shards(plan, max_shard_size)
    n = len(shards)
    names = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    stream = iter(tensors)
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards, strict=True):
        with open(out_dir / file_name, "wb") as f:
            f.write(_header(shard))
            for name, shape, dtype in shard:
                got_name, tensor = next(stream)
                if (got_name, tuple(tensor.shape), tensor.dtype) != (name, shape, dtype):
                    raise WeightMappingError(
                        f"export stream gave {got_name} {list(tensor.shape)} {tensor.dtype}, "
                        f"the plan expected {name} {list(shape)} {dtype}"
                    )
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(data.numpy().data)
                weight_map[name] = file_name
    if next(stream, None) is not None:
        raise WeightMappingError("export stream yielded more tensors than its plan")
    if n > 1:
        total = sum(_nbytes(item) for item in plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return names


def save_hf_checkpoint(
    out_dir: str | Path,
    model_chunks: list[Any],
    model_cfg: ModelConfig,
    tokenizer_dir: str | Path | None = None,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory (``config.json`` + safetensors) on rank 0.

    Collective: every rank calls it. ``tokenizer_dir``: copy its tokenizer files too.
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` and vLLM load the result.
    """
    out = Path(out_dir)
    check_target(out, overwrite=overwrite)  # every rank: no hang
    plans = stage_plans(model_chunks, model_cfg)
    stream = gather_hf_weights(model_chunks, model_cfg, plans)
    if _rank() != 0:
        for _ in stream:
            pass
        dist.barrier()  # rank 0 renames the directory before anyone returns
        return out
    # A directory of our own (unique name, beside the target: the same file system), renamed
    # into place; nothing this call did not create is ever removed (``out`` itself only
    # with ``overwrite``, and then after the new export is complete).
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}."))
    try:
        plan = [item for stage in plans for item in stage]
        files = write_safetensors_stream(tmp, plan, stream, max_shard_size)
        config = json.dumps(hf_config_from_model_config(model_cfg), indent=2)
        (tmp / "config.json").write_text(config)
        if tokenizer_dir is not None:
            copied = [n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
            if not copied:
                raise FileNotFoundError(f"{tokenizer_dir} holds none of {list(TOKENIZER_FILES)}")
            for name in copied:
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        tmp.chmod(0o755)  # mkdtemp makes 0700; an export is read by whoever serves it
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s (%d tensors in %d file(s))", out, len(plan), len(files))
    if dist.is_initialized():
        dist.barrier()
    return out


# ------------------------------------------------------------------ loading
def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file, from the index or the single file's header."""
    from safetensors import safe_open

    index = hf_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single)
    pickles = sorted(p.name for p in hf_dir.glob("*.bin"))
    hint = f" (found {pickles}: re-save with safe_serialization=True)" if pickles else ""
    raise FileNotFoundError(f"{hf_dir} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def check_hf_checkpoint(hf_dir: str | Path, model_cfg: ModelConfig) -> dict[str, Path]:
    """Check a Hugging Face directory against ``model_cfg`` before anything is loaded.

    Returns HF tensor name -> safetensors file. Raises ValueError/WeightMappingError naming the
    field or tensor when ``config.json``, the key set (missing or unexpected tensors) or the
    file format does not match.
    """
    hf_dir = Path(hf_dir)
    diffs = architecture_mismatches(model_config_from_hf(hf_dir), model_cfg)
    if diffs:
        raise ValueError(
            f"{hf_dir}/config.json does not match the model config (checkpoint vs config): "
            + "; ".join(diffs)
        )
    files = _weight_files(hf_dir)
    expected = hf_shapes(model_cfg)
    missing = [n for n in expected if n not in files]
    if missing:
        raise WeightMappingError(f"{hf_dir} lacks {len(missing)} tensor(s): {missing[:5]}")
    extra = [n for n in files if n not in expected and not n.endswith("rotary_emb.inv_freq")]
    if model_cfg.tie_word_embeddings and LM_HEAD in extra:
        extra.remove(LM_HEAD)
        logger.warning("%s: ignoring lm_head.weight of a tied model (embed_tokens is used)", hf_dir)
    if extra:
        raise WeightMappingError(
            f"{hf_dir} has {len(extra)} unexpected tensor(s) {extra[:5]}: another architecture?"
        )
    return files


def load_hf_checkpoint(hf_dir: str | Path, model_chunks: list[Any], model_cfg: ModelConfig) -> None:
    """Load a Hugging Face Llama/Qwen2 directory into this rank's Megatron chunks.

    Every rank calls it (no collectives); each reads only its own stage's tensors, full, and
    keeps its TP shard. Raises ValueError/WeightMappingError naming the field or tensor when
    the config, the key set or a shape does not match ``model_cfg``
    (:func:`check_hf_checkpoint`).
    """
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    files = check_hf_checkpoint(hf_dir, model_cfg)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def get(name: str) -> torch.Tensor:
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(
                    safe_open(str(path), framework="pt", device="cpu")
                )
            return handles[path].get_tensor(name)

        used = import_hf_weights(model_chunks, model_cfg, get)
    logger.info("loaded %d tensors from %s", len(set(used)), hf_dir)
