"""NeMo-Run experiment definitions for reco-megatron (optional extra ``nemo-run``).

No training logic here: every task is ``python -m reco_megatron.train CONFIG overrides...``
wrapped in a NeMo-Run ``Script`` and started by torchrun through an executor. See
:mod:`launch.executors` and :mod:`launch.experiments`, and ``docs/launch.md``.
"""
