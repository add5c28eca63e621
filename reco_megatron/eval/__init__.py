"""Evaluation: pass@k with the unbiased estimator, coverage and diversity metrics.

``metrics`` (pure: pass@k tables, rare-correct mass, diversity), ``runner`` (sample n per
problem with per-problem seeds and grade), ``checkpoints`` (HF or reco-megatron checkpoint ->
engine), ``report`` (JSON, markdown, PNG), ``pipeline`` (what ``reco-eval`` runs) and
``during_training`` (the trainer's periodic coverage evaluation). See ``docs/evaluation.md``.
"""
