"""The speculative-sampling step (Leviathan et al. 2023, Algorithm 1).

Given γ draft tokens x_i ~ q_i and the target distributions p_1..p_{γ+1}
from one forward pass, accept x_i while u_i < p_i(x_i)/q_i(x_i); at the first
rejection draw from the residual norm(max(0, p − q)), otherwise draw the
bonus token from p_{γ+1}. Each emitted token is then distributed exactly as
p, for any q — including a truncated or one-hot q — provided q is the
distribution the draft really sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.speculation.sampling import sample_from_probs


@dataclass
class Verdict:
    """Outcome of verifying one block of draft tokens."""

    n_accepted: int  # leading draft tokens kept, 0..γ
    next_token: int  # correction (n < γ) or bonus (n = γ) token, always emitted
    accept_probs: list[float] = field(default_factory=list)  # min(1, p_i(x_i)/q_i(x_i)), positions 1..n+1
    betas: list[float] = field(default_factory=list)  # Σ_x min(p_i, q_i), positions 1..n+1
    # (token, log-probability, top alternatives) of the n+1 emitted tokens, when the request asked for them
    logprobs: list | None = None

    @property
    def emitted(self) -> int:
        return self.n_accepted + 1


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) along the last axis.

    p, q: [..., vocab]. Where p ≤ q everywhere (only possible through rounding,
    since a rejection implies p(x) < q(x) for the drafted x and so mass
    elsewhere) fall back to p, which is then equal to q.
    """
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / torch.where(total > 0, total, 1.0), p)


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> Verdict:
    """`accept_prefix` for greedy decoding, without touching the vocabulary.

    There p_i is one-hot on the target's argmax and each q_i one-hot on its drafted token, so a token is
    kept iff it equals the argmax (min(1, p/q) is 1 or 0, whatever the uniform), the residual after a
    rejection is one-hot on the argmax, and so is the bonus. target_argmax: [γ+1].
    """
    gamma = len(draft_tokens)
    n = 0
    while n < gamma and draft_tokens[n] == target_argmax[n]:
        n += 1
    drawn = [1.0] * n + ([0.0] if n < gamma else [])  # min(1, p/q) and Σ min(p, q) of the positions tested
    return Verdict(n, int(target_argmax[n]), drawn, list(drawn))


def accept_prefix(
    draft_tokens: torch.Tensor,  # [γ] int64
    draft_probs: torch.Tensor,  # [γ, vocab] q_i, the distributions the tokens were sampled from
    target_probs: torch.Tensor,  # [γ+1, vocab] p_i, target distributions after the same prefixes
    u_accept: torch.Tensor,  # [γ] uniforms for the acceptance tests
    u_final: torch.Tensor,  # [γ+1] uniforms for the residual / bonus draw at each position
) -> Verdict:
    """One block's verdict: `accept_batch` of one."""
    return accept_batch(draft_tokens[None], [draft_tokens.shape[0]], draft_probs[None], target_probs[None],
                        u_accept[None], u_final[None])[0]


def accept_batch(
    draft_tokens: torch.Tensor,  # [B, G] int64; positions at or past a block's length hold any id
    lengths: list[int],  # block b drafted lengths[b] <= G tokens
    draft_probs: torch.Tensor,  # [B, G, vocab] q
    target_probs: torch.Tensor,  # [B, G+1, vocab] p
    u_accept: torch.Tensor,  # [B, G]
    u_final: torch.Tensor,  # [B, G+1]
) -> list[Verdict]:
    """The verdicts of B blocks at once, on their device: every block's tests (accept x_i while
    u_i < p_i(x_i)/q_i(x_i)), residual and bonus draws in a few batched ops, and ONE transfer of the verdicts to
    the host (a GPU step then synchronises once per step, not once per session and token). Row b's verdict
    depends only on its first lengths[b] tokens (its padding is never looked at)."""
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch, device=target_probs.device)
    drafted_k = torch.tensor(lengths, dtype=torch.long, device=rows.device)
    if gamma:
        p_x = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1).double()
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).double()
        ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-300), torch.zeros_like(p_x))  # [B, G]
        drafted = torch.arange(gamma, device=rows.device) < drafted_k[:, None]
        n = ((u_accept.double() < ratio) & drafted).long().cumprod(1).sum(1)  # [B]
        p_n = target_probs[rows, n]
        residual = residual_distribution(p_n, draft_probs[rows, n.clamp(max=gamma - 1)])
        final = torch.where((n < drafted_k)[:, None], residual, p_n)  # the residual after a rejection, else the bonus
        betas = torch.minimum(target_probs[:, :gamma], draft_probs).sum(-1).double()
    else:
        n = torch.zeros(batch, dtype=torch.long, device=rows.device)
        final, ratio = target_probs[:, 0], torch.zeros(batch, 0, dtype=torch.float64, device=rows.device)
        betas = ratio
    token = sample_from_probs(final, u_final[rows, n])
    host = torch.cat((n[:, None].double(), token[:, None].double(), ratio.clamp(max=1.0), betas), 1).tolist()
    verdicts = []
    for row, k in zip(host, lengths):
        accepted = int(row[0])
        looked = min(accepted + 1, k)  # positions whose verdict was actually drawn
        verdicts.append(Verdict(accepted, int(row[1]), row[2 : 2 + looked], row[2 + gamma : 2 + gamma + looked]))
    return verdicts
