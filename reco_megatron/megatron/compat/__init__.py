"""megatron-core compatibility: across versions and on CPU.

* :mod:`.versions`: the one place that knows the API differences between megatron-core 0.16
  and 0.19 (model building, parallel state, dist checkpointing);
* :mod:`.cpu_backend`: runs megatron-core on CPU over gloo (enable, seed, config checks),
  applying the redirections in :mod:`.cpu_patches` and the RNG tracker in :mod:`.cpu_rng`.
  Only the engine's start-up path (:mod:`reco_megatron.megatron.distributed`) enables it.

Importing this package imports nothing of megatron-core.
"""
