"""``LossConfig``: every knob of the GRPO-family / ReCo loss, and the paper presets.

One dataclass drives one code path (:func:`reco_megatron.algo.policy_loss`): GRPO, Dr.GRPO,
DAPO, CISPO and ReCo differ only in field values. Build one with
``LossConfig.preset("reco", eps_high=0.28)`` or directly with keywords.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

Objective = Literal["ppo_clip", "reco", "cispo"]
AdvantageMode = Literal["grpo", "dr_grpo", "rloo"]
WeightMode = Literal["sequence", "geometric", "empirical", "prefix", "prefix_empirical", "none"]
RatioMode = Literal["importance", "bernoulli", "categorical"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k3"]
WeightPolicy = Literal["auto", "proximal", "behaviour"]

# The valid values, read from the Literal types above (one list per choice): the loader checks
# the types of a config file; these let direct callers of the algo functions be checked too.
OBJECTIVES: tuple[str, ...] = get_args(Objective)
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)
WEIGHT_MODES: tuple[str, ...] = get_args(WeightMode)
PER_TOKEN_WEIGHT_MODES: tuple[str, ...] = ("prefix", "prefix_empirical")
"""Response weight modes that give one weight per token (``[B*G, T]``), not per response."""
TOKEN_ID_WEIGHT_MODES: tuple[str, ...] = ("empirical", "prefix_empirical")
"""Response weight modes that count token-identical responses / prefixes (need token ids)."""
RATIO_MODES: tuple[str, ...] = get_args(RatioMode)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
WEIGHT_POLICIES: tuple[str, ...] = get_args(WeightPolicy)
LOGPROB_WEIGHT_MODES: tuple[str, ...] = ("sequence", "geometric", "prefix")
"""Response weight modes that read log-probs (the others count tokens or give ones)."""


def _choice(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {valid}, got {value!r}")


def _optional_positive(name: str, value: object, hint: str) -> None:
    if value is not None and not (
        isinstance(value, int | float) and math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r} ({hint})")


@dataclass(kw_only=True)
class LossConfig:
    """Configuration of :func:`reco_megatron.algo.policy_loss` and its helpers.

    The defaults are the ReCo loss (sequence weights, Bernoulli ratio, PPO-clip mask, trust
    region on c, token-mean, no KL term): the ``reco`` preset. See ``docs/loss.md`` for the
    formulas and :meth:`preset` for the baselines.
    """

    PRESET_FIELD: ClassVar[str] = "preset"
    """The config key naming a preset (``loss.preset: grpo`` in a file or on the command
    line): the section starts from :meth:`preset` and its other keys change it from there."""

    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        """The names :meth:`preset` accepts."""
        return tuple(PRESETS)

    objective: Objective = "reco"
    """Per-token surrogate: ``ppo_clip`` (GRPO/DAPO, ``-min(rA, clip(r)A)``), ``reco``
    (``-sg(c) A log p`` masked where the PPO clip fires) or ``cispo``
    (``-sg(min(r, 1+cispo_eps_high)) A log p``)."""

    advantage_mode: AdvantageMode = "grpo"
    """How :func:`group_advantages` centres rewards: ``grpo`` ((R-mean)/(std+eps)),
    ``dr_grpo`` (R-mean), ``rloo`` (R minus the leave-one-out mean)."""

    advantage_eps: float = 1e-6
    """Added to the group std in ``grpo`` advantages (> 0)."""

    response_weight: WeightMode = "sequence"
    """ReCo response weight (:func:`response_weights`): ``sequence`` (1/max(1, G pi_old)),
    ``geometric``, ``empirical`` (1/duplicate count), the per-token ``prefix``
    (1/max(1, G pi_old(o_<=t)) on token t) and ``prefix_empirical`` (1/number of group
    members sharing the prefix o_<=t), or ``none``. Any mode other than ``none`` requires
    ``weights=`` in :func:`policy_loss`, computed on complete groups."""

    response_weight_policy: WeightPolicy = "auto"
    """Which policy's log-probs the response weight reads: the expected occurrence of a
    response is under the policy that *sampled* its group. ``proximal``: pi_old, the trainer's
    old-policy pass. ``behaviour``: mu, the log-probs the rollout engine reported while
    sampling (``rollout_logprobs``; a batch without them is an error). ``auto``: ``behaviour``
    with ``rollout.placement=separate`` and ``max_staleness`` > 0 (groups from weights up to
    that many steps old), else ``proximal``, so colocated runs (and separate ones with
    ``max_staleness=0``) are unchanged. Only the modes that read
    log-probs (``sequence``, ``geometric``, ``prefix``) depend on it; ``empirical``,
    ``prefix_empirical`` and ``none`` are unaffected. The clip and the token ratio c stay on
    pi / pi_old whatever this says (``docs/loss.md``, "Stale groups")."""

    token_ratio: RatioMode = "bernoulli"
    """Detached per-token coefficient of the ``reco`` objective: ``importance`` (r = p/p_old,
    gives the PPO-clip gradient), ``bernoulli`` (p(1-p) / p_old(1-p_old)) or ``categorical``
    ((1 - sum p^2) / (1 - sum p_old^2)). Only ``importance`` is valid for other objectives."""

    eps_low: float = 0.2
    """PPO clip below: the ratio r may fall to ``1 - eps_low`` (in (0, 1))."""

    eps_high: float = 0.2
    """PPO clip above: the ratio r may rise to ``1 + eps_high`` (> 0; DAPO clip-higher: 0.28)."""

    dual_clip_c: float | None = None
    """Dual-clip constant (> 1) for tokens with A < 0: ``ppo_clip`` bounds the loss at ``-c A``
    (so no gradient where r > c, as verl/NeMo-RL); ``reco`` and ``cispo`` drop the policy term
    of those tokens (the same mask, so ``reco`` with ``token_ratio="importance"`` keeps
    ``ppo_clip``'s gradient). ``None`` disables it (Ye et al. 2020, "Mastering Complex Control
    in MOBA Games")."""

    cispo_eps_high: float = 0.2
    """CISPO cap of the detached IS weight: ``min(r, 1 + cispo_eps_high)`` (> 0)."""

    cispo_eps_low: float | None = None
    """Optional CISPO floor ``max(r, 1 - cispo_eps_low)``; ``None`` (MiniMax-M1) disables it."""

    prob_eps: float = 1e-6
    """Probabilities are clamped to ``[prob_eps, 1 - prob_eps]`` (and variances to
    ``>= prob_eps``) in the Bernoulli / categorical ratios (in (0, 0.5))."""

    c_max: float = 10.0
    """Cap of the *value* of the Bernoulli / categorical ratio c (>= 1). A backstop, not a
    trust region: a capped token still gets the coefficient ``c_max`` (see ``c_trust``)."""

    c_trust: bool = True
    """Trust region on the variance ratio c of the ``reco`` objective (the ReCo default):
    the coefficient is ``min(c, 1 + eps_c)``, and a token has no policy term where
    ``c > 1 + eps_c`` and the update would raise c further (Bernoulli: ``A (1 - 2p) > 0``;
    categorical: ``A (sum_v p_v^2 - p) > 0``). ``False`` gives the paper's plain form
    (coefficient c, capped only by ``c_max``). No effect with ``token_ratio="importance"``,
    whose ratio the PPO clip already bounds. ``docs/loss.md`` says why."""

    c_trust_eps: float | None = None
    """Width eps_c of the trust region on c (> 0); ``None`` uses ``eps_high``."""

    max_log_ratio: float = 20.0
    """``log r`` is clamped to ``[-max_log_ratio, max_log_ratio]`` before ``exp`` so r stays
    finite (as in verl); beyond it r carries no gradient (> 0)."""

    geometric_w_min: float = 0.1
    """Lower clip of the group-normalised ``geometric`` weights (in (0, 1])."""

    geometric_w_max: float = 10.0
    """Upper clip of the group-normalised ``geometric`` weights (>= 1)."""

    kl_coef: float = 0.0
    """Coefficient of the per-token KL penalty to the reference policy (>= 0); > 0 requires
    ``ref_logp=`` in :func:`policy_loss`. ReCo (this default and every ``reco*`` preset) uses
    none: its clip mask on r and trust region on c already keep the update near the old
    policy, a KL term costs a reference copy of the model, and the measured runs
    (``docs/results/``) train without one. The ``grpo`` preset keeps its paper's 0.04."""

    kl_estimator: KLEstimator = "k3"
    """KL(pi || ref) estimator on sampled tokens: ``k1`` (log p - log p_ref) or ``k3``
    (exp(log p_ref - log p) - (log p_ref - log p) - 1, Schulman's unbiased low-variance one)."""

    kl_clamp: float | None = None
    """Clamp of the per-token KL estimate to ``[-kl_clamp, kl_clamp]`` (> 0); no gradient
    where it binds. ``None`` (default) keeps the estimate exact. verl (k3) and NeMo-RL
    (``kl_output_clamp_value``) clamp at 10: set 10.0 to match their GRPO-with-KL runs."""

    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (>= 0; the loss gets ``- entropy_coef * H``); > 0
    requires ``stats=`` (TokenStats with entropy) in :func:`policy_loss`."""

    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar: ``token_mean`` (sum / global token count),
    ``seq_mean_token_mean`` (per-sequence mean, summed / global sequence count) or
    ``seq_mean_token_sum_norm`` (per-sequence sum / ``loss_normalizer``, summed / global
    sequence count; Dr.GRPO)."""

    loss_normalizer: float | None = None
    """Constant dividing each sequence's token sum in ``seq_mean_token_sum_norm``, typically the
    maximum response length in tokens; required (> 0) for that aggregation."""

    tis_cap: float | None = None
    """Truncated importance sampling of the train/inference mismatch: each token's policy
    term is multiplied by ``min(p_old / p_rollout, tis_cap)`` (detached), where ``p_rollout``
    is what the inference engine reported; kept separate from ReCo's token ratio. ``None``
    disables it; 2.0 is the value of the TIS paper (>= 1: the weight is 1 where the engine
    sampled from pi_old). Needs ``rollout_logp=``. With stale groups
    (``rollout.placement=separate``) it is decoupled PPO's correction from the behaviour
    policy to pi_old (``docs/loss.md``, "Stale groups")."""

    def __post_init__(self) -> None:
        _optional_positive("tis_cap", self.tis_cap, "2.0 is the TIS paper's value")
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ValueError(
                f"tis_cap must be >= 1 or None, got {self.tis_cap!r}: where the rollout engine "
                "sampled from pi_old the weight is min(1, tis_cap), so a cap below 1 scales "
                "every token down (2.0 is the TIS paper's value)"
            )
        _choice("objective", self.objective, OBJECTIVES)
        _choice("advantage_mode", self.advantage_mode, ADVANTAGE_MODES)
        _choice("response_weight", self.response_weight, WEIGHT_MODES)
        _choice("response_weight_policy", self.response_weight_policy, WEIGHT_POLICIES)
        _choice("token_ratio", self.token_ratio, RATIO_MODES)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if not 0.0 < self.eps_low < 1.0:
            raise ValueError(
                f"eps_low must be in (0, 1), got {self.eps_low}: the ratio's lower bound is "
                "1 - eps_low (GRPO/DAPO use 0.2)"
            )
        if not self.eps_high > 0.0:
            raise ValueError(
                f"eps_high must be > 0, got {self.eps_high}: the ratio's upper bound is "
                "1 + eps_high (GRPO uses 0.2, DAPO 0.28)"
            )
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 or None, got {self.dual_clip_c} (try 3.0)")
        if not self.cispo_eps_high > 0.0:
            raise ValueError(f"cispo_eps_high must be > 0, got {self.cispo_eps_high}")
        if self.cispo_eps_low is not None and not 0.0 < self.cispo_eps_low <= 1.0:
            raise ValueError(f"cispo_eps_low must be in (0, 1] or None, got {self.cispo_eps_low}")
        if not self.advantage_eps > 0.0:
            raise ValueError(f"advantage_eps must be > 0, got {self.advantage_eps} (try 1e-6)")
        if not 0.0 < self.prob_eps < 0.5:
            raise ValueError(f"prob_eps must be in (0, 0.5), got {self.prob_eps} (try 1e-6)")
        if not self.c_max >= 1.0:
            raise ValueError(f"c_max must be >= 1, got {self.c_max}: c == 1 at the old policy")
        if self.c_trust_eps is not None and not (
            isinstance(self.c_trust_eps, int | float)
            and math.isfinite(self.c_trust_eps)
            and self.c_trust_eps > 0
        ):
            raise ValueError(
                f"c_trust_eps must be a finite number > 0 or None (= eps_high), got "
                f"{self.c_trust_eps!r}; to turn the trust region on c off, set c_trust=False"
            )
        if not self.max_log_ratio > 0.0:
            raise ValueError(f"max_log_ratio must be > 0, got {self.max_log_ratio} (try 20.0)")
        if not 0.0 < self.geometric_w_min <= 1.0:
            raise ValueError(
                f"geometric_w_min must be in (0, 1], got {self.geometric_w_min}: weights are "
                "normalised to mean 1 before clipping"
            )
        if not self.geometric_w_max >= 1.0:
            raise ValueError(f"geometric_w_max must be >= 1, got {self.geometric_w_max}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")
        _optional_positive(
            "kl_clamp",
            self.kl_clamp,
            "10.0 matches verl and NeMo-RL; None keeps the KL estimate exact",
        )
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"entropy_coef must be finite and >= 0, got {self.entropy_coef}")
        if self.objective != "reco" and self.token_ratio != "importance":
            raise ValueError(
                f"token_ratio={self.token_ratio!r} only applies to objective='reco', got "
                f"objective={self.objective!r}: set token_ratio='importance' or objective='reco'"
            )
        if self.aggregation == "seq_mean_token_sum_norm" and not (
            self.loss_normalizer is not None and self.loss_normalizer > 0
        ):
            raise ValueError(
                f"aggregation='seq_mean_token_sum_norm' needs loss_normalizer > 0, got "
                f"{self.loss_normalizer}: pass the maximum response length in tokens, e.g. "
                "loss_normalizer=4096"
            )
        if self.loss_normalizer is not None and not self.loss_normalizer > 0:
            raise ValueError(f"loss_normalizer must be > 0 or None, got {self.loss_normalizer}")

    @property
    def c_trust_bound(self) -> float | None:
        """``1 + eps_c`` when the trust region on c acts (``reco`` objective, a variance
        ratio, ``c_trust``), else ``None``."""
        if not (self.c_trust and self.objective == "reco" and self.token_ratio != "importance"):
            return None
        return 1.0 + (self.eps_high if self.c_trust_eps is None else self.c_trust_eps)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LossConfig:
        """The config of a named method, with keyword overrides applied on top.

        - ``grpo``: DeepSeekMath (arXiv 2402.03300): PPO clip eps 0.2, k3 KL with beta 0.04,
          std-normalised advantages. Aggregated ``token_mean`` like every preset but Dr.GRPO
          (the paper writes a per-sequence mean: pass ``aggregation="seq_mean_token_mean"``).
        - ``dapo``: DAPO (arXiv 2503.14476): clip-higher eps_low 0.2 / eps_high 0.28,
          token-mean, no KL.
        - ``dr_grpo``: Dr.GRPO (arXiv 2503.20783): advantage without std, per-sequence token
          sum over a constant (``seq_mean_token_sum_norm``), eps 0.2, no KL. The constant is the
          generation budget and has no universal value: pass ``loss_normalizer=<max tokens>``.
        - ``cispo``: MiniMax-M1 (arXiv 2506.13585): detached ``min(r, 1 + eps_high)`` weight on
          every token, no lower bound, token-mean, no KL. The paper tunes only eps_high and does
          not print it; 0.2 follows verl's canonical CISPO example (clip_ratio_high=0.2).
        - ``reco``: ReCo (arXiv 2607.26862): GRPO plus sequence response weights and the
          Bernoulli token ratio under the PPO-clip mask, with the trust region on c
          (``c_trust``, width eps_high): without it ReCo can collapse (``docs/loss.md``); no
          KL term (:attr:`kl_coef`). ``LossConfig()`` is this preset.
        - ``reco_plain``: ``reco`` in the paper's plain form (``c_trust=False``: coefficient c,
          capped only by ``c_max``), for ablations.
        - ``reco_response_only`` / ``reco_token_only``: ReCo with the token ratio set back to
          ``importance`` / the response weight set to ``none`` (ablations).

        Raises ``ValueError`` listing the valid names for an unknown ``name``.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown loss preset {name!r}; valid presets: {sorted(PRESETS)}")
        fields = {**PRESETS[name], **overrides}
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"unknown LossConfig field(s) {unknown}; valid: {sorted(valid)}")
        return cls(**fields)


_GRPO: dict[str, Any] = dict(
    objective="ppo_clip",
    advantage_mode="grpo",
    response_weight="none",
    token_ratio="importance",
    c_trust=False,
    eps_low=0.2,
    eps_high=0.2,
    kl_coef=0.04,
    kl_estimator="k3",
    aggregation="token_mean",
)
_RECO: dict[str, Any] = {
    **_GRPO,
    "kl_coef": 0.0,  # why: the docstring of LossConfig.kl_coef
    "objective": "reco",
    "response_weight": "sequence",
    "token_ratio": "bernoulli",
    "c_trust": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": _GRPO,
    "dapo": {**_GRPO, "eps_high": 0.28, "kl_coef": 0.0},
    "dr_grpo": {
        **_GRPO,
        "advantage_mode": "dr_grpo",
        "kl_coef": 0.0,
        "aggregation": "seq_mean_token_sum_norm",
    },
    "cispo": {**_GRPO, "objective": "cispo", "cispo_eps_high": 0.2, "kl_coef": 0.0},
    "reco": _RECO,
    "reco_plain": {**_RECO, "c_trust": False},
    "reco_response_only": {**_RECO, "token_ratio": "importance", "c_trust": False},
    "reco_token_only": {**_RECO, "response_weight": "none"},
}
"""Field values of each named preset; see :meth:`LossConfig.preset`."""
