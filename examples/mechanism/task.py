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

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if self.k_max > self.vocab**self.length:
            raise ValueError(
                f"k_max={self.k_max} exceeds the {self.vocab}**{self.length} possible answers"
            )
        if not (0.0 < self.skew <= 1.0 and 0.0 <= self.noise < 1.0):
            raise ValueError(f"need skew in (0, 1] and noise in [0, 1), got {self}")


class Task:
    """Valid answers ``answers [P, K_max, L]`` (``valid [P, K_max]`` marks the real ones) and
    the SFT preference ``pref [P, K_max]`` (probabilities over each prompt's valid answers)."""

    def __init__(self, spec: TaskSpec, seed: int) -> None:
        self.spec = spec
        g = torch.Generator().manual_seed(seed)
        p, kmax, length = spec.prompts, spec.k_max, spec.length
        self.k = torch.randint(spec.k_min, spec.k_max + 1, (p,), generator=g)
        self.answers = torch.zeros(p, kmax, length, dtype=torch.long)
        self.valid = torch.zeros(p, kmax, dtype=torch.bool)
        for q in range(p):
            found: list[list[int]] = []  # in drawing order: the preference order is random
            while len(found) < int(self.k[q]):
                ans = torch.randint(spec.vocab, (length,), generator=g).tolist()
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
        rand = torch.randint(spec.vocab, (n, spec.length), generator=g)
        return prompts, torch.where(noisy.unsqueeze(1), rand, targets)


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
    lp = policy.token_logp(prompts, task.answers.reshape(p * kmax, length)).sum(-1)
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


def sft(policy: Policy, task: Task, steps: int, seed: int, lr: float = SFT_LR) -> float:
    """Cross-entropy on the skewed mix; returns the last batch's mean token NLL."""
    g = torch.Generator().manual_seed(seed + 7919)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    nll = torch.zeros(())
    for _ in range(steps):
        prompts, targets = task.sft_batch(SFT_BATCH, g)
        nll = -policy.token_logp(prompts, targets).mean()
        opt.zero_grad()
        nll.backward()
        opt.step()
    return float(nll.detach())
