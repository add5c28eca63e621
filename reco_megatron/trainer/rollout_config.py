"""The ``rollout`` section: how responses are sampled, by which engine, and where it runs.

``placement: colocated`` (the default) generates on the trainer's own ranks between updates;
``placement: separate`` runs ``num_workers`` rollout worker processes on their own devices
(:mod:`reco_megatron.rollout_worker`) that generate while the trainer trains, on weights at
most ``max_staleness`` steps old (docs/rollout.md, "Separate placement").
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from reco_megatron.rollout.vllm_requests import VLLM_MAX_TEMPERATURE, VLLM_MIN_TEMPERATURE

Placement = Literal["colocated", "separate"]
WorkerLaunch = Literal["spawn", "external"]
WorkerFailure = Literal["stop", "continue"]


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling of G responses per prompt."""

    engine: Literal["embedded", "vllm", "megatron"] = "embedded"
    """``embedded`` (transformers on CPU/GPU, the debug default), ``vllm`` (GPU, the largest
    jobs where vLLM is installed) or ``megatron`` (megatron-core decoding on the trainer's own
    chunks and TP/PP layout: no weight conversion; docs/rollout.md)."""
    group_size: int = 8
    """G, responses per prompt (the paper: 8)."""
    prompts_per_step: int = 8
    """Prompts per rollout batch (global, over all data-parallel ranks)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 disables)."""
    max_new_tokens: int = 64
    """Longest response; longer generations end with finish_reason 'length'."""
    max_prompt_len: int = 64
    """Longest prompt in tokens (rows above it are an error or a counted skip)."""
    gpu_memory_utilization: float = 0.5
    """vLLM only: fraction of GPU memory for weights + KV cache when colocated."""
    max_batch_size: int | Literal["auto"] = "auto"
    """Embedded and megatron engines: rows (prompt copies) per forward; never changes the
    samples. ``auto``: the megatron engine decodes all rows of a step in one batch, as many as
    its KV cache may hold (``kv_cache_gib``; finished rows leave the batch as it goes), the
    embedded engine 64."""
    kv_cache_gib: float | None = None
    """Megatron engine: the most memory its KV cache may take per rank (GiB), which bounds
    ``max_batch_size: auto``. None: half the device memory free at the first generation on
    a GPU, 4 GiB on the CPU."""
    keep_kv_cache: bool = True
    """Megatron engine: keep the KV cache (and on a GPU the captured decode steps) from one
    step's generation to the next, through the update. ``false`` frees it when generation
    returns, so the update gets that memory back (and the next generation allocates and
    captures again): set it when the update runs out of memory next to the cache."""
    prefix_cache_gib: float | None = None
    """Megatron engine: the most memory per rank for keys and values kept from one call to the
    next, so that a multi-turn episode's next turn prefills only its new tokens (its last
    action token and the observation), not the whole context again. Dropped at every weight
    sync. None: half of ``kv_cache_gib``'s bound with ``env`` set, off without (single-turn
    prompts never extend an earlier call's); 0: off."""

    env: str = ""
    """Multi-turn episodes: the environment every response is an episode of (a built-in name
    such as ``calculator``, ``module:Class`` or ``path/to/file.py:Class``; docs/howto.md,
    "Write your own environment"). Empty: single-turn responses. ``max_new_tokens`` then
    bounds the whole episode (actions and observations)."""
    max_turns: int = 8
    """``env``: most actions per episode (the episode ends after the ``max_turns``-th)."""
    env_workers: int = 8
    """``env``: isolated worker processes running the environments; at most this many
    environment steps run at once (steps of episodes in different workers overlap)."""
    env_step_timeout_s: float = 30.0
    """``env``: time limit of one ``reset`` or ``step`` call; past it the worker is killed and
    replaced, and the episode scores 0 (counted in ``env_timeout_sum``). With
    ``placement=separate`` it must stay below ``generate_timeout_s`` (one generation call of a
    worker runs whole episodes)."""
    turn_discount: float = 1.0
    """``env``: per-turn rewards (``Step.reward``) count ``turn_discount**k`` at turn k
    (0-based) and are added to the reward function's score of the whole episode; 1.0 sums
    them."""

    placement: Placement = "colocated"
    """``colocated``: every step generates on the trainer's ranks, then trains (one after the
    other). ``separate``: ``num_workers`` rollout workers, each one engine in its own process
    on its own devices, generate the next steps' groups while the trainer trains; the weights
    reach them over a process group of their own after every step."""
    max_staleness: int | None = None
    """K: the step ``s`` trains only on groups generated with weights of step ``>= s - 1 - K``
    (older ones are dropped, counted in ``groups_dropped_stale`` and generated again). ``None``:
    1 with ``placement=separate``, 0 colocated. 0 with ``separate`` is a synchronous but
    disaggregated run (bit for bit the colocated one with one worker)."""
    num_workers: int = 1
    """``placement=separate``: rollout worker processes (each generates whole groups)."""
    worker_launch: WorkerLaunch = "spawn"
    """``spawn``: the trainer's first rank starts the workers on its node (``python -m
    reco_megatron.rollout_worker``; one GPU each from ``worker_gpus``, or the CPU).
    ``external``: the job script starts them (``ROLLOUT_NODES`` in ``slurm/reco.sbatch``); they
    find the trainer through ``<output_dir>/rollout/address.json``."""
    worker_gpus: list[int] = field(default_factory=list)
    """``worker_launch=spawn`` on GPUs: the GPU index of each worker (``num_workers`` entries,
    none of them a trainer rank's). Empty: the workers run on the CPU."""
    worker_timeout_s: float = 300.0
    """A worker silent this long (no heartbeat, no result) is dead; every wait on a worker
    gives up after it, naming the worker. Also how long the trainer waits for the workers to
    start (a vLLM worker loads its model first)."""
    generate_timeout_s: float = 3600.0
    """``placement=separate``: a worker whose one generation call (its share of a step's
    groups) has run this long is hung (a stuck engine whose heartbeats still come): it says so
    and exits, and the trainer treats it as lost (``worker_failure``). Raise it when one call
    legitimately takes longer (very long responses on few GPUs)."""
    worker_failure: WorkerFailure = "stop"
    """A dead worker: ``stop`` saves a checkpoint and exits 75 (resumable) naming it;
    ``continue`` hands its groups to the others and trains on (the run stops when none is
    left)."""
    bind_address: str = "auto"
    """``placement=separate``: the address (an IP of this node) the trainer's control port
    listens on. ``auto``: loopback when the trainer spawns every worker
    (``worker_launch=spawn``), this node's address (its hostname's) for external workers on
    other nodes; never every interface (``0.0.0.0`` only when named here). Only processes
    holding the run's keys (``rollout/address.json``) get in either way."""
    weight_bucket_mb: int = 256
    """Weight push to the workers: tensors travel in flat buckets of about this many MiB."""

    def __post_init__(self) -> None:
        for name in (
            "group_size",
            "prompts_per_step",
            "max_new_tokens",
            "max_prompt_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name} must be a positive integer, got {value!r}")
        size = self.max_batch_size
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"rollout.max_batch_size must be a positive integer or 'auto', got {size!r}"
            )
        gib = self.kv_cache_gib
        if gib is not None and (
            isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0
        ):
            raise ValueError(f"rollout.kv_cache_gib must be > 0 GiB or null, got {gib!r}")
        gib = self.prefix_cache_gib
        if gib is not None and (
            isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib < 0
        ):
            raise ValueError(f"rollout.prefix_cache_gib must be >= 0 GiB or null, got {gib!r}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2, got {self.group_size}: group advantages "
                "compare the responses to one prompt (the paper uses 8)"
            )
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.temperature must be > 0, got {self.temperature} (RL needs sampling)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.engine == "vllm" and not (
            VLLM_MIN_TEMPERATURE <= self.temperature <= VLLM_MAX_TEMPERATURE
        ):
            raise ValueError(
                f"rollout.temperature={self.temperature} with rollout.engine=vllm: vLLM takes "
                f"temperatures in [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}] (it rejects "
                "larger ones and silently raises smaller ones); pick one in that range"
            )
        for name in ("num_workers", "weight_bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name} must be a positive integer, got {value!r}")
        self._check_env()
        self._check_placement()
        if self.bind_address != "auto":
            try:
                ipaddress.ip_address(self.bind_address)
            except ValueError:
                raise ValueError(
                    f"rollout.bind_address must be 'auto' or an IP address of this node, got "
                    f"{self.bind_address!r} (e.g. 10.0.0.12, 127.0.0.1)"
                ) from None

    def _check_env(self) -> None:
        for name in ("max_turns", "env_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name} must be a positive integer, got {value!r}")
        timeout = self.env_step_timeout_s
        if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(
                f"rollout.env_step_timeout_s must be a number of seconds > 0, got {timeout!r}"
            )
        gamma = self.turn_discount
        if isinstance(gamma, bool) or not (isinstance(gamma, int | float) and 0 < gamma <= 1):
            raise ValueError(
                f"rollout.turn_discount must be in (0, 1] (1.0 sums per-turn rewards), got "
                f"{gamma!r}"
            )
        if not isinstance(self.env, str):
            raise ValueError(f"rollout.env must be a string (module:Class), got {self.env!r}")

    @property
    def staleness_bound(self) -> int:
        """K as the run uses it (``max_staleness``, or its placement's default)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.placement == "separate" else 0

    def _check_placement(self) -> None:
        k = self.max_staleness
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(
                f"rollout.max_staleness must be an integer >= 0 (or null for the placement's "
                f"default), got {k!r}"
            )
        for name in ("worker_timeout_s", "generate_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"rollout.{name} must be a number of seconds > 0, got {value!r}")
        if self.placement == "colocated":
            if k:
                raise ValueError(
                    f"rollout.max_staleness={k} with rollout.placement=colocated: a colocated "
                    "run generates with the current weights; set rollout.placement=separate to "
                    "train on groups up to K steps old"
                )
            return
        if self.engine == "megatron":
            raise ValueError(
                "rollout.placement=separate with rollout.engine=megatron: the megatron engine "
                "decodes on the trainer's own model chunks; use rollout.engine=vllm (GPU) or "
                "embedded (CPU, debugging) for separate workers"
            )
        generate, timeout = self.generate_timeout_s, self.env_step_timeout_s
        if self.env and generate <= timeout:
            raise ValueError(
                f"rollout.generate_timeout_s={generate!r} <= rollout.env_step_timeout_s="
                f"{timeout!r} with rollout.env={self.env!r} and rollout.placement=separate: a "
                "worker's generation call runs whole episodes, environment steps included, and "
                "would count as hung; raise rollout.generate_timeout_s well above "
                "rollout.env_step_timeout_s (at least max_turns times it)"
            )
        gpus = self.worker_gpus
        bad = [g for g in gpus if isinstance(g, bool) or not isinstance(g, int) or g < 0]
        if bad:
            raise ValueError(f"rollout.worker_gpus must be GPU indices >= 0, got {gpus!r}")
        if gpus and (self.worker_launch != "spawn" or len(gpus) != self.num_workers):
            raise ValueError(
                f"rollout.worker_gpus={gpus!r}: give one GPU per spawned worker "
                f"(rollout.num_workers={self.num_workers}, rollout.worker_launch="
                f"{self.worker_launch}); external workers take the GPUs their job step gives "
                "them"
            )
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"rollout.worker_gpus={gpus!r} names a GPU twice: one per worker")
