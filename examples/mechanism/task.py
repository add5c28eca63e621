"""The mechanism task and policy: K equally valid short answers per prompt, a skewed start.

Task (one per seed): ``P`` prompts; prompt q has ``K_q`` (4..8) valid answers, each a random
sequence of ``L`` tokens over a vocabulary of ``V`` (distinct within the prompt). Reward 1 for
a valid answer, 0 otherwise, so every valid answer is equally good.

Policy: a small autoregressive MLP, shared by all prompts (so updates on one prompt move
the others, as in a language model). The logits of token t are
``W2 relu(W1 (E_q[q] + E_pos[t] + sum_{s<t} E_tok[s, o_s]) + b1) + b2``.

Start: SFT on a skewed mix: with probability ``1 - noise`` a valid answer, the j-th preferred
with probability proportional to ``skew**j``, else a uniformly random sequence (mostly invalid),
so the start is imperfect (pass@1 < 1, room for RL) and prefers some valid answers.

Everything measured about the valid answers is exact: their sequence log-probs are scored,
not sampled (``valid_stats``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

POLICY_DIM, POLICY_HIDDEN = 64, 128
"""Embedding width and hidden width of :class:`Policy`."""
SFT_LR, SFT_BATCH = 3e-3, 256
"""Adam learning rate and batch size of :func:`sft`."""


@dataclass(kw_only=True)
class TaskSpec:
    """Shape of the task and of the skewed start."""

    prompts: int = 32
    """Number of prompts P."""
    vocab: int = 8
    """Token vocabulary V."""
    length: int = 4
    """Answer length L in tokens (every response has exactly L tokens)."""
    k_min: int = 4
    """Fewest valid answers per prompt."""
    k_max: int = 8
    """Most valid answers per prompt."""
    skew: float = 0.5
    """SFT mix: the j-th preferred valid answer has weight ``skew**j`` (< 1: skewed)."""
    noise: float = 0.5
    """SFT mix: share of uniformly random sequences (mostly invalid)."""
    tree: bool = False
    """Long answers whose valid set is a tree (the length study, ``length.py``): a response
    of L tokens is ``decisions`` choices, one at the start of each segment of about
    L / decisions tokens, and free filler tokens after each choice (the reward reads only the
    choices, as a grader reads the answer, not the wording). The valid choice strings of a
    prompt share openings: string j > 0 copies the first d choices of an earlier one (parent
    and d uniform), takes a different choice at d and random ones after it. The policy is
    :class:`SegmentPolicy`. False: independent random strings of L tokens, :class:`Policy`
    (the L = 4 experiment of ``docs/results/mechanism.md``)."""
    decisions: int = 4
    """Number of choices (segments) of a ``tree`` answer (<= L)."""
    typo: float = 0.1
    """``tree`` SFT mix: each filler token repeats its segment's choice, except with this
    probability a uniformly random token (free variation of the wording, in [0, 1))."""

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if not 0.0 <= self.typo < 1.0:
            raise ValueError(f"typo must be in [0, 1), got {self.typo}")
        if self.tree and not 1 <= self.decisions <= self.length:
            raise ValueError(f"need 1 <= decisions <= length, got {self.decisions}, {self.length}")
        if self.k_max > self.vocab ** (self.decisions if self.tree else self.length):
            raise ValueError(
                f"k_max={self.k_max} exceeds the {self.vocab}**{self.length} possible answers"
            )
        if not (0.0 < self.skew <= 1.0 and 0.0 <= self.noise < 1.0):
            raise ValueError(f"need skew in (0, 1] and noise in [0, 1), got {self}")


def _branch(found: list[list[int]], fresh: list[int], vocab: int, g: torch.Generator) -> list[int]:
    """``fresh`` grafted onto an earlier answer: its first d tokens (parent and d uniform),
    then a token other than the parent's at d, then ``fresh``'s tokens."""
    parent = found[int(torch.randint(len(found), (1,), generator=g))]
    d = int(torch.randint(len(parent), (1,), generator=g))
    other = (parent[d] + 1 + int(torch.randint(vocab - 1, (1,), generator=g))) % vocab
    return [*parent[:d], other, *fresh[d + 1 :]]


class Task:
    """Valid answers ``answers [P, K_max, L]`` (``valid [P, K_max]`` marks the real ones) and
    the SFT preference ``pref [P, K_max]`` (probabilities over each prompt's valid answers)."""

    def __init__(self, spec: TaskSpec, seed: int) -> None:
        self.spec = spec
        g = torch.Generator().manual_seed(seed)
        p, kmax, length = spec.prompts, spec.k_max, spec.length
        if spec.tree:  # the valid set is over the choices; the fillers are free
            self.starts, self.segment_of = segments(length, spec.decisions)
            length = spec.decisions
        self.k = torch.randint(spec.k_min, spec.k_max + 1, (p,), generator=g)
        self.answers = torch.zeros(p, kmax, length, dtype=torch.long)
        self.valid = torch.zeros(p, kmax, dtype=torch.bool)
        for q in range(p):
            found: list[list[int]] = []  # in drawing order: the preference order is random
            n_tok = spec.decisions if spec.tree else length
            while len(found) < int(self.k[q]):
                ans = torch.randint(spec.vocab, (n_tok,), generator=g).tolist()
                if spec.tree and found:
                    ans = _branch(found, ans, spec.vocab, g)
                if ans not in found:
                    found.append(ans)
            self.answers[q, : len(found)] = torch.tensor(found)
            self.valid[q, : len(found)] = True
        w = spec.skew ** torch.arange(kmax, dtype=torch.float64)
        w = torch.where(self.valid, w.expand(p, kmax), torch.zeros(()))
        self.pref = w / w.sum(dim=1, keepdim=True)
        # Base-V codes of the valid answers, for reward lookup.
        self._base = spec.vocab ** torch.arange(length - 1, -1, -1)
        codes = (self.answers * self._base).sum(-1)
        self._valid_codes = [set(codes[q, self.valid[q]].tolist()) for q in range(p)]

    def reward(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[N]`` 1.0 where ``responses [N, L]`` is a valid answer of ``prompts [N]``."""
        if self.spec.tree:
            responses = responses[:, self.starts]
        codes = (responses * self._base).sum(-1).tolist()
        return torch.tensor(
            [float(c in self._valid_codes[q]) for q, c in zip(prompts.tolist(), codes, strict=True)]
        )

    def sft_batch(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompts [n], targets [n, L])`` from the skewed SFT mix."""
        spec = self.spec
        prompts = torch.randint(spec.prompts, (n,), generator=g)
        j = torch.multinomial(self.pref[prompts], 1, generator=g).squeeze(1)
        targets = self.answers[prompts, j].clone()
        noisy = torch.rand(n, generator=g) < spec.noise
        rand = torch.randint(spec.vocab, targets.shape, generator=g)
        targets = torch.where(noisy.unsqueeze(1), rand, targets)
        if not spec.tree:
            return prompts, targets
        held = targets[:, self.segment_of]  # [n, L]: each choice held for its segment
        typo = torch.rand(held.shape, generator=g) < spec.typo
        typo[:, self.starts] = False
        rand = torch.randint(spec.vocab, held.shape, generator=g)
        return prompts, torch.where(typo, rand, held)


def segments(length: int, decisions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts [decisions], segment_of [L])``: the first position of each of ``decisions``
    near-equal segments of ``length`` positions, and each position's segment."""
    sizes = torch.tensor([len(c) for c in torch.arange(length).chunk(decisions)])
    starts = torch.cumsum(sizes, 0) - sizes
    return starts, torch.arange(decisions).repeat_interleave(sizes)


class Policy(nn.Module):
    """The autoregressive MLP policy over fixed-length answers."""

    def __init__(self, spec: TaskSpec, dim: int = POLICY_DIM, hidden: int = POLICY_HIDDEN) -> None:
        super().__init__()
        self.spec = spec
        self.e_prompt = nn.Embedding(spec.prompts, dim)
        self.e_pos = nn.Parameter(torch.zeros(spec.length, dim))
        self.e_tok = nn.Parameter(0.1 * torch.randn(spec.length, spec.vocab, dim))
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, spec.vocab))

    def logits(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Teacher-forced next-token logits ``[N, L, V]`` for ``responses [N, L]``."""
        length = responses.shape[1]
        tok = self.e_tok[torch.arange(length), responses]  # [N, L, D]: E_tok[s, o_s]
        prefix = torch.cumsum(tok, dim=1) - tok  # sum over s < t
        x = self.e_prompt(prompts).unsqueeze(1) + self.e_pos.unsqueeze(0) + prefix
        return self.mlp(x)

    def token_logp(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``log pi(o_t | q, o_<t)`` ``[N, L]``."""
        logp = torch.log_softmax(self.logits(prompts, responses), dim=-1)
        return logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def sample(
        self, prompts: torch.Tensor, g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``(responses [N, L], logp [N, L], next-token probs [N, L, V])`` at T = 1."""
        n, length = prompts.shape[0], self.spec.length
        out = torch.zeros(n, length, dtype=torch.long)
        x = self.e_prompt(prompts)
        probs = torch.zeros(n, length, self.spec.vocab)
        for t in range(length):
            p = torch.softmax(self.mlp(x + self.e_pos[t]), dim=-1)
            probs[:, t] = p
            out[:, t] = torch.multinomial(p, 1, generator=g).squeeze(1)
            x = x + self.e_tok[t, out[:, t]]
        logp = torch.log(probs.gather(-1, out.unsqueeze(-1)).squeeze(-1))
        return out, logp, probs


class SegmentPolicy(nn.Module):
    """The ``tree`` task's policy: the choices come from a :class:`Policy` over the
    ``decisions`` choice positions (so the probability of a choice string is exact, whatever
    the fillers), each filler token from ``softmax(F[choice of its segment] + b[t])``."""

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__()
        self.spec = spec
        self.choice = Policy(dataclasses.replace(spec, length=spec.decisions, tree=False))
        starts, segment_of = segments(spec.length, spec.decisions)
        self.register_buffer("starts", starts, persistent=False)
        self.register_buffer("segment_of", segment_of, persistent=False)
        self.f_choice = nn.Parameter(torch.zeros(spec.vocab, spec.vocab))
        self.f_pos = nn.Parameter(torch.zeros(spec.length, spec.vocab))

    def _filler_logp(self, choices: torch.Tensor) -> torch.Tensor:
        """``[N, L, V]`` filler log-probs given the choices ``[N, decisions]``."""
        return torch.log_softmax(self.f_choice[choices[:, self.segment_of]] + self.f_pos, -1)

    def answer_logp(self, prompts: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
        """``log pi(c_k | q, c_<k)`` ``[N, decisions]`` of choice strings."""
        return self.choice.token_logp(prompts, choices)

    def token_logp(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``log pi(o_t | q, o_<t)`` ``[N, L]`` (choices and fillers)."""
        choices = responses[:, self.starts]
        filler = self._filler_logp(choices).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        out = filler.clone()
        out[:, self.starts] = self.answer_logp(prompts, choices)
        return out

    @torch.no_grad()
    def sample(
        self, prompts: torch.Tensor, g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``(responses [N, L], logp [N, L], next-token probs [N, L, V])`` at T = 1."""
        choices, _, choice_probs = self.choice.sample(prompts, g)
        probs = self._filler_logp(choices).exp()
        n, length, v = probs.shape
        out = torch.multinomial(probs.reshape(-1, v), 1, generator=g).view(n, length)
        out[:, self.starts] = choices
        probs[:, self.starts] = choice_probs
        logp = torch.log(probs.gather(-1, out.unsqueeze(-1)).squeeze(-1))
        return out, logp, probs


def make_policy(spec: TaskSpec) -> nn.Module:
    """:class:`SegmentPolicy` for the ``tree`` task, else :class:`Policy`."""
    return SegmentPolicy(spec) if spec.tree else Policy(spec)


@torch.no_grad()
def valid_stats(policy: Policy, task: Task, n_samples: int) -> dict[str, float]:
    """Exact statistics of the policy's distribution over each prompt's valid answers, averaged
    over prompts:

    - ``pass1``: probability of a valid answer, ``sum_j pi(a_j)``;
    - ``entropy``: entropy (nats) of ``pi(a_j) / sum_j pi(a_j)`` over the valid answers;
    - ``entropy_norm``: the same divided by ``log K_q`` (1 = uniform over the valid answers);
    - ``distinct``: expected number of distinct valid answers among ``n_samples`` samples,
      ``sum_j 1 - (1 - pi(a_j))**n``;
    - ``top_share``: renormalised probability of the most likely valid answer.
    """
    p, kmax, length = task.answers.shape
    prompts = torch.arange(p).repeat_interleave(kmax)
    answers = task.answers.reshape(p * kmax, length)
    score = policy.answer_logp if isinstance(policy, SegmentPolicy) else policy.token_logp
    lp = score(prompts, answers).sum(-1)
    lp = lp.view(p, kmax).double().masked_fill(~task.valid, -math.inf)
    prob = lp.exp()
    mass = prob.sum(1)
    q = torch.softmax(lp, dim=1)
    ent = -(torch.where(q > 0, q * q.log(), torch.zeros(())).sum(1))
    distinct = (1.0 - (1.0 - prob) ** n_samples).sum(1)
    return {
        "pass1": float(mass.mean()),
        "entropy": float(ent.mean()),
        "entropy_norm": float((ent / task.k.double().log()).mean()),
        "distinct": float(distinct.mean()),
        "top_share": float(q.max(1).values.mean()),
    }


@torch.no_grad()
def token_pool(policy: Policy, group_size: int, seed: int) -> torch.Tensor:
    """Next-token distributions ``[P * G * L, V]`` at the tokens of G samples per prompt: the
    per-token statistics the synthetic length sweep draws from."""
    prompts = torch.arange(policy.spec.prompts).repeat_interleave(group_size)
    _, _, probs = policy.sample(prompts, torch.Generator().manual_seed(30_000 + seed))
    return probs.reshape(-1, policy.spec.vocab)


def sft(
    policy: nn.Module, task: Task, steps: int, seed: int, lr: float = SFT_LR, batch: int = SFT_BATCH
) -> float:
    """Cross-entropy on the skewed mix; returns the last batch's mean token NLL."""
    g = torch.Generator().manual_seed(seed + 7919)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    nll = torch.zeros(())
    for _ in range(steps):
        prompts, targets = task.sft_batch(batch, g)
        nll = -policy.token_logp(prompts, targets).mean()
        opt.zero_grad()
        nll.backward()
        opt.step()
    return float(nll.detach())
