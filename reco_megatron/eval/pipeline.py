"""The evaluation pipeline behind ``reco-eval``: checkpoints x dataset -> tables and a plot.

:class:`EvalSettings` holds the protocol; :func:`run_evaluation` loads the dataset once,
evaluates every checkpoint on the same problems with the same per-problem seeds, and writes
``passk.json``, ``passk.md`` and ``passk.png`` into ``out_dir``. The paper protocol
(T = 0.6, top-p = 0.95, n = 256, vLLM) is the default on GPU; on CPU the sample count defaults
to 16 (see ``docs/evaluation.md``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reco_megatron.data.chat import PromptFormatter
from reco_megatron.data.dataset import DatasetConfig, PromptDataset
from reco_megatron.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from reco_megatron.eval import report
from reco_megatron.eval.checkpoints import EngineName, as_hf_dir, build_engine, checkpoint_kind
from reco_megatron.eval.metrics import check_kmax, coverage_summary, ks_up_to
from reco_megatron.eval.runner import EvalProblem, evaluate_problems
from reco_megatron.rewards.pool import RewardPool
from reco_megatron.rewards.pool_config import RewardPoolConfig
from reco_megatron.rewards.registry import answer_key_spec, resolve_answer_key
from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

PAPER_PROTOCOL: dict[str, Any] = {"temperature": 0.6, "top_p": 0.95, "n": 256}
"""The paper-style protocol: T = 0.6, top-p 0.95, n = 256 samples per problem."""


@dataclass(kw_only=True)
class EvalSettings:
    """One evaluation: what to sample, how to grade, where to write."""

    checkpoints: list[tuple[str, str]]
    """``(label, path)`` pairs: HF directories or reco-megatron checkpoints."""
    data: str
    """Local ``.jsonl`` / ``.parquet`` file of problems."""
    out_dir: str
    """Where ``passk.json``, ``passk.md``, ``passk.png`` (and exported checkpoints) go."""
    tokenizer: str = ""
    """SentencePiece ``.model`` or HF tokenizer directory; empty: the first HF checkpoint's."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Field names of the data file (``prompt``, ``answer``, ``id`` by default)."""
    template: str = "{prompt}\n"
    """Prompt template when the tokenizer has no chat template."""
    reward: str = "math"
    """Grader: ``math``, ``countdown`` or ``module:function``."""
    reward_workers: int = 2
    """Reward worker processes."""
    answer_key: str = ""
    """Names the solution of a response, to count distinct correct solutions per problem:
    ``module:function`` (``(response, gold) -> str | None``, run in this process), ``none``,
    or empty for the reward's built-in key if it has one (countdown)."""
    n: int = 16
    """Samples per problem (the paper: 256)."""
    kmax: int = 16
    """Largest k reported; ``k`` runs over 1, 2, 4, ... up to it (needs ``n >= kmax``)."""
    temperature: float = 0.6
    """Sampling temperature (the paper: 0.6)."""
    top_p: float = 0.95
    """Nucleus threshold (the paper: 0.95)."""
    max_new_tokens: int | None = None
    """Longest response in tokens; None: the longest that fits every model's context next to
    the longest prompt, at most ``default_max_new_tokens``."""
    default_max_new_tokens: int = 64
    """Cap of the fitted length when ``max_new_tokens`` is None (vLLM: 3072)."""
    seed: int = 0
    """Evaluation seed; each problem's samples are seeded by ``(seed, problem id)``."""
    limit: int = 0
    """Evaluate only the first ``limit`` problems (0: all)."""
    engine: EngineName = "embedded"
    """``embedded`` (transformers, CPU default) or ``vllm`` (GPU)."""
    device: str = "cpu"
    """Device of the embedded engine."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism."""
    progress: bool = True
    """tqdm progress bar while sampling."""

    def __post_init__(self) -> None:
        if not self.checkpoints:
            raise ValueError("no checkpoint given: pass at least one checkpoint directory")
        for name in ("n", "kmax", "max_new_tokens", "default_max_new_tokens", "reward_workers"):
            value = getattr(self, name)
            if name == "max_new_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_kmax(self.kmax, self.n)
        if self.engine not in ("embedded", "vllm"):
            raise ValueError(f"engine must be 'embedded' or 'vllm', got {self.engine!r}")

    def protocol(self) -> dict[str, Any]:
        """The sampling protocol recorded next to the results."""
        keys = ("n", "kmax", "temperature", "top_p", "max_new_tokens", "seed", "reward", "engine")
        return {key: getattr(self, key) for key in keys} | {
            "data": self.data,
            "answer_key": self.answer_key_spec(),
        }

    def answer_key_spec(self) -> str:
        """The answer key in use: the given spec, the reward's built-in, or ``""`` (none)."""
        return answer_key_spec(self.reward, self.answer_key)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """A SentencePiece ``.model`` file or a Hugging Face tokenizer directory."""
    path = Path(spec)
    if path.suffix == ".model" and path.is_file():
        return SentencePieceTokenizer(path)
    if path.is_dir():
        return HFTokenizer(str(path))
    raise FileNotFoundError(
        f"tokenizer {str(spec)!r} is neither a SentencePiece .model file nor a directory: pass "
        "--tokenizer examples/tiny/countdown_sp.model or a local HF model directory"
    )


def load_problems(settings: EvalSettings, tokenizer: Tokenizer) -> list[EvalProblem]:
    """The dataset's problems, formatted and tokenized (``limit`` applied)."""
    dataset = PromptDataset(settings.data, settings.dataset, tokenizer=tokenizer)
    formatter = PromptFormatter(tokenizer=tokenizer, template=settings.template)
    records = list(dataset)
    if settings.limit:
        records = records[: settings.limit]
    return [
        EvalProblem(id=r.id, prompt_ids=tokenizer.encode(formatter.format(r.prompt)), gold=r.answer)
        for r in records
    ]


def _context(hf_dir: Path) -> int | None:
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    value = config.get("max_position_embeddings")
    return int(value) if value else None


def fit_max_new_tokens(settings: EvalSettings, longest_prompt: int, contexts: list[int]) -> int:
    """The response length: ``settings.max_new_tokens`` checked against the smallest model
    context, or (None) the longest that fits, at most ``default_max_new_tokens``.

    Raises:
        ValueError: the prompts leave no room, or the given length does not fit.
    """
    context = min(contexts) if contexts else None
    room = None if context is None else context - longest_prompt
    if room is not None and room < 1:
        raise ValueError(
            f"the longest prompt has {longest_prompt} tokens, the model's context is {context}: "
            "no room for a response; use shorter prompts (--limit, another --data)"
        )
    if settings.max_new_tokens is None:
        fitted = settings.default_max_new_tokens if room is None else room
        fitted = min(fitted, settings.default_max_new_tokens)
        logger.info(
            "max_new_tokens=%d (context %s, longest prompt %d)", fitted, context, longest_prompt
        )
        return fitted
    if room is not None and settings.max_new_tokens > room:
        raise ValueError(
            f"--max-new-tokens {settings.max_new_tokens} + the longest prompt "
            f"({longest_prompt} tokens) exceeds the model's context of {context}: pass "
            f"--max-new-tokens {room} or less (or leave it out to fit it)"
        )
    return settings.max_new_tokens


def run_evaluation(settings: EvalSettings) -> dict[str, Any]:
    """Evaluate every checkpoint; write the outputs; return ``{"entries", "paths"}``.

    The inputs are checked before ``out_dir`` is created; when the evaluation fails, an
    ``out_dir`` it created is removed again unless something was written into it (e.g. an
    export, reused by the next call).
    """
    for _, path in settings.checkpoints:  # fail fast, before any export or sampling
        checkpoint_kind(path)
    if not Path(settings.data).is_file():
        raise FileNotFoundError(f"data file {settings.data!r} does not exist")
    answer_key = resolve_answer_key(settings.answer_key_spec())
    out = Path(settings.out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _evaluate(settings, out, answer_key)
    except BaseException:
        if created and not any(p.is_file() for p in out.rglob("*")):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _evaluate(
    settings: EvalSettings, out: Path, answer_key: Callable[[str, str], object] | None
) -> dict[str, Any]:
    hf_dirs = [(label, as_hf_dir(path, out / "exported")) for label, path in settings.checkpoints]
    tok_spec = settings.tokenizer or str(hf_dirs[0][1])
    tokenizer = load_tokenizer(tok_spec)
    problems = load_problems(settings, tokenizer)
    if not problems:
        raise ValueError(f"{settings.data} holds no problems")
    longest = max(len(p.prompt_ids) for p in problems)
    contexts = [c for _, d in hf_dirs if (c := _context(d)) is not None]
    max_new_tokens = fit_max_new_tokens(settings, longest, contexts)
    ks = ks_up_to(settings.kmax)
    sampling = SamplingParams(
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,),
    )
    entries: list[dict[str, Any]] = []
    pool = RewardPool(RewardPoolConfig(reward=settings.reward, num_workers=settings.reward_workers))
    try:
        for (label, src), (_, hf_dir) in zip(settings.checkpoints, hf_dirs, strict=True):
            start = time.perf_counter()
            engine = build_engine(
                hf_dir,
                engine=settings.engine,
                max_model_len=longest + max_new_tokens,
                eos_token_ids=(tokenizer.eos_id,),
                seed=settings.seed,
                device=settings.device,
                tensor_parallel_size=settings.tensor_parallel_size,
            )
            try:
                results = evaluate_problems(
                    engine,
                    problems,
                    n=settings.n,
                    sampling=sampling,
                    grade=lambda texts, golds: pool.score(texts, golds).scores,
                    decode=tokenizer.decode,
                    seed=settings.seed,
                    progress=settings.progress,
                    desc=label,
                    answer_key=answer_key,
                )
            finally:
                engine.close()
            summary = coverage_summary(results, ks)
            summary["time_s"] = time.perf_counter() - start
            logger.info(
                "%s: %s",
                label,
                " ".join(f"{k}={summary[k]:.3f}" for k in summary if k.startswith("pass@")),
            )
            protocol = {**settings.protocol(), "max_new_tokens": max_new_tokens}
            entries.append(report.entry(label, src, summary, results, protocol))
    finally:
        pool.close()
    rows = [(e["label"], e["summary"]) for e in entries]
    paths = {
        "json": report.write_json(out / "passk.json", entries),
        "png": report.plot_passk(
            out / "passk.png",
            rows,
            bands=report.problem_bands(entries),
            title=report.passk_title(entries[0]["protocol"], len(entries[0]["problems"])),
            note="bands: 95% bootstrap interval over problems",
        ),
    }
    md = out / "passk.md"
    md.write_text(report.markdown_table(rows), encoding="utf-8")
    paths["md"] = md
    (out / "settings.json").write_text(
        json.dumps(asdict(settings), indent=1, default=str) + "\n", encoding="utf-8"
    )
    return {"entries": entries, "paths": paths}
