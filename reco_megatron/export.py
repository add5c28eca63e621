"""Export a reco-megatron training checkpoint to a Hugging Face model directory.

Usage (one process, CPU; the checkpoint may have been written at any TP/PP, it reshards)::

    python -m reco_megatron.export CKPT_DIR HF_OUT_DIR [--tokenizer TOKENIZER] [--overwrite]
    reco-export runs/tiny_cpu/checkpoints hf/tiny       # tokenizer from runs/tiny_cpu/config.yaml
    reco-export runs/llama8b/checkpoints hf/llama8b-reco --tokenizer /models/Llama-3.1-8B-Instruct

``CKPT_DIR`` is a ``step_*`` directory or the checkpoint root holding ``latest``. The model is
rebuilt at TP=PP=1 from ``meta.json`` (``layout.model``), the model weights are loaded
(optimizer state and RNG are skipped), and ``config.json`` + ``model.safetensors`` (sharded
at ``--max-shard-size``) are written; ``transformers`` and vLLM load the result. Memory: the
whole model in its saved dtype, plus one tensor. megatron-bridge is not needed.

The tokenizer is the run's own (``data.tokenizer`` in the ``config.yaml`` beside the
checkpoints) unless ``--tokenizer`` names another: a Hugging Face tokenizer directory is
copied; a SentencePiece ``.model`` (the tiny default) is converted to ``tokenizer.json``
(:mod:`reco_megatron.data.hf_tokenizer`), checked to give the same ids as SentencePiece on
the run's prompts, and given a ``generation_config.json`` with its EOS / BOS / pad ids, so
``AutoTokenizer`` and ``AutoModelForCausalLM.generate`` work on the export as is. A
tokenizer named by ``--tokenizer`` must work (exit 2 otherwise); one found in the run's config
that is missing (relative paths start at the current directory) or does not convert exactly
is skipped with a warning, and the weights are exported alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from reco_megatron.utils.logging import get_logger
from reco_megatron.utils.noise import quiet_known_warnings

logger = get_logger("reco_megatron.export")

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or a byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB, 500MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def resolve_checkpoint(path: str | Path) -> Path:
    """A ``step_*`` directory from itself or from a root holding ``latest``."""
    from reco_megatron.megatron import CheckpointError, latest_checkpoint

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if (path / "meta.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint (no meta.json) nor a checkpoint root (no 'latest'): "
            "pass the directory given to save_checkpoint or one of its step_* directories"
        )
    return latest


def run_config_of(checkpoint: Path) -> dict[str, Any] | None:
    """The ``config.yaml`` of the run that wrote ``checkpoint`` (a ``step_*`` directory or
    the checkpoints root), as a plain mapping; None when there is none."""
    import yaml

    for parent in [checkpoint, *checkpoint.parents][:3]:
        if (parent / "config.yaml").is_file():
            data = yaml.safe_load((parent / "config.yaml").read_text(encoding="utf-8"))
            return {**data, "_run_dir": str(parent)} if isinstance(data, dict) else None
    return None


def _sample_texts(run: dict[str, Any], limit: int = 256) -> list[str]:
    """Prompts of the run (formatted with its template) to check a converted tokenizer on."""
    data = run.get("data") or {}
    path = Path(data.get("train_path") or Path(run["_run_dir"]) / "data" / "train.jsonl")
    field = (data.get("dataset") or {}).get("prompt_field", "prompt")
    template = data.get("template", "{prompt}")
    texts: list[str] = []
    if path.suffix == ".jsonl" and path.is_file():
        with path.open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line) if line.strip() else None
                if isinstance(row, dict) and isinstance(row.get(field), str):
                    texts += [row[field], template.format(prompt=row[field])]
                if len(texts) >= limit:
                    break
    return texts


def prepare_tokenizer(spec: str | Path, workdir: Path, texts: list[str]) -> Path:
    """A directory of HF tokenizer files for ``spec``: itself when it is a directory, else
    (a SentencePiece ``.model``) its conversion written under ``workdir``.

    Raises:
        FileNotFoundError: ``spec`` does not exist.
        ValueError: the conversion gives other ids than SentencePiece on ``texts``.
    """
    from reco_megatron.data.hf_tokenizer import encoding_mismatches, sentencepiece_to_hf

    path = Path(spec)
    if path.is_dir():
        return path
    if not path.is_file() or path.suffix != ".model":
        raise FileNotFoundError(
            f"tokenizer {str(path)!r} is neither a tokenizer directory nor a SentencePiece "
            ".model file (relative paths start at the current directory): pass --tokenizer"
        )
    import sentencepiece as spm

    out = workdir / "tokenizer"
    sentencepiece_to_hf(path, out)
    bad = encoding_mismatches(path, out, texts)
    if bad:
        raise ValueError(
            f"the converted tokenizer of {path} gives other ids than SentencePiece on {bad} of "
            f"{len(texts)} prompts (only BPE models without a dummy prefix convert exactly): "
            "pass --tokenizer with a Hugging Face tokenizer directory"
        )
    sp = spm.SentencePieceProcessor(model_file=str(path))
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    generation = {k: v for k, v in ids.items() if v >= 0}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def _tokenizer_for(spec: str | Path | None, run: dict[str, Any] | None, work: Path) -> Path | None:
    """The tokenizer directory to copy into the export (see module doc), or None."""
    from_run = spec is None and run is not None
    if from_run:
        spec = (run.get("data") or {}).get("tokenizer") or None
        if spec:
            logger.info("tokenizer from %s/config.yaml: %s", run["_run_dir"], spec)
    if spec is None:
        return None
    try:
        return prepare_tokenizer(spec, work, _sample_texts(run) if run is not None else [])
    except (FileNotFoundError, ValueError) as exc:
        if not from_run:
            raise
        # Found on its own: the weights are still worth exporting.
        logger.warning("exporting without a tokenizer: %s", exc)
        return None


def _write_hf(
    path: Path,
    meta: dict[str, Any],
    out_dir: str | Path,
    tokenizer_dir: Path | None,
    max_shard_size: int | None,
    overwrite: bool,
) -> Path:
    import torch.distributed as dist

    from reco_megatron.megatron import (
        DEFAULT_MAX_SHARD_SIZE,
        CheckpointError,
        ModelConfig,
        ParallelConfig,
        UnsafeCheckpointError,
        build_model,
        initialize_parallel,
        load_model_and_optimizer,
        save_hf_checkpoint,
        transformer_config,
        verify_checkpoint,
    )

    try:
        saved = ModelConfig(**meta["layout"]["model"])
        saved_tp = int(meta["layout"]["tensor_model_parallel_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}/meta.json has no valid layout.model ({exc})") from exc
    # Same padded vocabulary as the saved run, so the embedding shards line up at TP=1.
    model_cfg = replace(
        saved, make_vocab_size_divisible_by=saved.make_vocab_size_divisible_by * saved_tp
    )
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError("export_checkpoint runs in a single process (world size 1)")
    parallel = ParallelConfig()
    initialize_parallel(parallel, seed=0)
    config = transformer_config(model_cfg, parallel, on_gpu=False)
    model = build_model(model_cfg, config, pre_process=True, post_process=True, on_gpu=False)
    verify_checkpoint(path)  # manifest and .metadata, before any byte is deserialised
    try:
        load_model_and_optimizer(str(path / "dist"), [model], None)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"could not read the model weights of {path} ({type(exc).__name__}: {exc})"
        ) from exc
    return save_hf_checkpoint(
        out_dir,
        [model],
        saved,
        tokenizer_dir,
        max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        overwrite=overwrite,
    )


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a reco-megatron checkpoint to a Hugging Face directory (see module doc).

    Runs in one process (a world of 1 is started when ``torch.distributed`` is not). The
    output folder and the tokenizer are checked before the model is built.
    """
    from reco_megatron.megatron import check_target, read_meta

    check_target(out_dir, overwrite=overwrite)  # before anything is read or loaded
    path = resolve_checkpoint(checkpoint)
    meta = read_meta(path)
    with tempfile.TemporaryDirectory(prefix="reco-export-") as work:
        tok = _tokenizer_for(tokenizer_dir, run_config_of(path), Path(work))
        out = _write_hf(path, meta, out_dir, tok, max_shard_size, overwrite)
    logger.info("exported %s (step %s) -> %s", path, meta.get("step"), out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``reco-export``; returns the exit status (2 on a bad input)."""
    parser = argparse.ArgumentParser(prog="reco-export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="step_* directory or checkpoint root with 'latest'")
    parser.add_argument("out_dir", help="Hugging Face output directory (created)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory or SentencePiece .model (default: the run's data.tokenizer)",
    )
    parser.add_argument("--max-shard-size", type=parse_size, default=None, help="e.g. 5GB")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    args = parser.parse_args(argv)
    quiet_known_warnings()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU export: no device memory needed
    from reco_megatron.megatron import CheckpointError

    try:
        export_checkpoint(
            args.checkpoint,
            args.out_dir,
            args.tokenizer,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
        )
    except FileExistsError:
        logger.error("%s exists and is not empty: pass --overwrite to replace it", args.out_dir)
        return 2
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    except OSError as exc:  # the disk filled, the place went read-only while writing
        logger.error("cannot write the export %s: %s", args.out_dir, exc)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
