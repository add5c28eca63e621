"""Coverage during training: pass@k and diversity on held-out prompts every ``eval.interval``.

The trainer owns one :class:`CoverageEvaluator` on global rank 0 (the rank that scores
rewards) and calls :meth:`CoverageEvaluator.maybe_run` after every step (and once at step 0).
It samples on the rollout engine that already holds the current weights, with per-problem
seeds of its own, so evaluating never changes the training trajectory. Each evaluation appends
one row to ``<output_dir>/eval.jsonl`` (``step``, ``pass@k`` for k = 1, 2, 4, ... kmax,
``unique_frac``, ``distinct_2``, ``rare_correct_frac``, ``solved_frac``, ``time_s``);
:meth:`finish` draws ``coverage_curve.png`` from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reco_megatron.data.chat import PromptFormatter
from reco_megatron.data.dataset import DatasetConfig, PromptDataset
from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.eval.metrics import check_kmax, coverage_summary, ks_up_to
from reco_megatron.eval.report import plot_over_training
from reco_megatron.eval.runner import EvalProblem, evaluate_problems
from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import SamplingParams
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True)
class EvalConfig:
    """Periodic pass@k on held-out prompts (``eval`` section of the run config).

    Its sampling is the evaluation protocol's own (``temperature``, ``top_p``), not the
    rollout's; only ``max_new_tokens: 0`` inherits ``rollout.max_new_tokens``, and prompts are
    kept up to ``rollout.max_prompt_len`` (``docs/configuration.md``, "One key per setting").
    """

    interval: int = 0
    """Steps between evaluations (0 disables; when on, step 0 and the last step are included)."""
    n: int = 8
    """Samples per held-out prompt (the paper: 256 at the end of training; keep small here)."""
    kmax: int = 0
    """Largest k reported (0: ``n``); k runs over 1, 2, 4, ... kmax."""
    num_prompts: int = 16
    """Held-out prompts evaluated (the first ones of the file; 0: all)."""
    temperature: float = 0.6
    """Sampling temperature of the evaluation (the paper protocol: 0.6)."""
    top_p: float = 0.95
    """Nucleus threshold of the evaluation (the paper protocol: 0.95)."""
    max_new_tokens: int = 0
    """Longest response (0: ``rollout.max_new_tokens``)."""
    seed: int = 0
    """Evaluation seed (per-problem seeds derive from it and the problem id)."""

    def __post_init__(self) -> None:
        for name in ("interval", "kmax", "num_prompts", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"eval.{name} must be an int >= 0, got {value!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"eval.n must be an int >= 1, got {self.n!r}")
        check_kmax(self.kmax or self.n, self.n)


class CoverageEvaluator:
    """Evaluates the rollout engine's current policy on a fixed held-out prompt set."""

    def __init__(
        self,
        cfg: EvalConfig,
        eval_path: str | Path,
        out_dir: str | Path,
        tokenizer: Tokenizer,
        formatter: PromptFormatter,
        *,
        max_new_tokens: int,
        max_prompt_len: int,
        answer_key: Callable[[str, str], str | None] | None = None,
    ) -> None:
        """``answer_key``: names a response's solution, to count distinct correct solutions
        (``distinct_correct`` in the rows; e.g. the reward's built-in key)."""
        self.cfg = cfg
        self.answer_key = answer_key
        self.out = Path(out_dir)
        self.tokenizer = tokenizer
        data = PromptDataset(
            eval_path, DatasetConfig(max_prompt_len=max_prompt_len), tokenizer=tokenizer
        )
        records = list(data)[: cfg.num_prompts] if cfg.num_prompts else list(data)
        self.problems = [
            EvalProblem(r.id, tokenizer.encode(formatter.format(r.prompt)), r.answer)
            for r in records
        ]
        self.ks = ks_up_to(cfg.kmax or cfg.n)
        self.sampling = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens or max_new_tokens,
            stop_token_ids=(tokenizer.eos_id,),
        )
        self.rows: list[dict[str, Any]] = []
        log = self.out / "eval.jsonl"  # a resumed run does not evaluate a logged step again
        lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
        self._done: set[int] = {json.loads(x)["step"] for x in lines if x.strip()}
        logger.info(
            "coverage eval every %d steps on %d held-out prompts of %s (n=%d)",
            cfg.interval,
            len(self.problems),
            eval_path,
            cfg.n,
        )

    def due(self, step: int, max_steps: int) -> bool:
        """Whether ``step`` is an evaluation step (0, every ``interval``, and the last)."""
        if not self.cfg.interval or step in self._done:
            return False
        return step == 0 or step % self.cfg.interval == 0 or step == max_steps

    def maybe_run(
        self,
        step: int,
        max_steps: int,
        engine: RolloutEngine,
        grade: Callable[[list[str], list[str]], list[float]],
    ) -> dict[str, Any] | None:
        """Evaluate when :meth:`due`; append the row to ``eval.jsonl`` and return it."""
        if not self.due(step, max_steps):
            return None
        start = time.perf_counter()
        results = evaluate_problems(
            engine,
            self.problems,
            n=self.cfg.n,
            sampling=self.sampling,
            grade=grade,
            decode=self.tokenizer.decode,
            seed=self.cfg.seed,
            answer_key=self.answer_key,
        )
        row: dict[str, Any] = {"step": step, **coverage_summary(results, self.ks)}
        row["time_s"] = time.perf_counter() - start
        self.rows.append(row)
        self._done.add(step)
        with (self.out / "eval.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        logger.info(
            "eval step %d: %s unique %.2f rare-correct %.2f (%.1f s)",
            step,
            " ".join(f"pass@{k}={row[f'pass@{k}']:.3f}" for k in self.ks),
            row["unique_frac"],
            row["rare_correct_frac"],
            row["time_s"],
        )
        return row

    def finish(self) -> Path | None:
        """Draw ``coverage_curve.png`` from every row of ``eval.jsonl`` (resumed runs too)."""
        path = self.out / "eval.jsonl"
        if not path.exists():
            return None
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return plot_over_training(self.out / "coverage_curve.png", rows)


def held_out_path(data_eval_path: str, out_dir: str | Path) -> Path | None:
    """``data.eval_path`` when set, else the generated countdown ``data/eval.jsonl``."""
    if data_eval_path:
        return Path(data_eval_path)
    path = Path(out_dir) / "data" / "eval.jsonl"
    return path if path.exists() else None
