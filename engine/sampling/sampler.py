"""Next-token selection: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Semantics (OpenAI / vLLM):
- Penalties act on the logits first and apply to greedy requests too. Repetition is
  multiplicative over prompt and output tokens (positive logits divided, negative
  multiplied); presence and frequency are additive over output tokens only.
- Then, for sampled requests: temperature, top-k, top-p (on the top-k survivors,
  renormalised), min-p (relative to the most likely survivor).
- Drawing is by inversion: one uniform ``u`` per row, and the token is the first whose
  cumulative probability passes ``u``, so ``i`` is picked with probability ``p_i``. For a
  seeded request ``u`` is a hash of ``(seed, p)`` where ``p`` is the output position, so
  the token depends only on (seed, p, logits): not on the batch, the worker, or an
  earlier resume.
- Logprobs are of the raw model distribution (log_softmax of the logits before
  penalties, temperature and filters), as vLLM reports by default.
- A grammar (``constrain``) masks the penalised logits of its rows before any of that:
  greedy and sampled picks alike only see tokens the grammar allows. A row it masks whole
  still gets an id inside the vocabulary (one the grammar refuses: the request ends).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from wire.params import SamplingParams

_MASK64 = (1 << 64) - 1
# Masks disallowed tokens of (B, V) logits in place (a grammar's bitmask).
Constraint = Callable[[torch.Tensor], None]


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position) -> a 63-bit generator seed."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs of one row besides its logits."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens sampled so far; the new one is output position len()


@dataclass(frozen=True)
class SampleOutput:
    """B rows, K = the most top logprobs any row asked for (0 if none)."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor  # (B,) float32, NaN where the row asked for no logprobs
    top_ids: torch.Tensor  # (B, K) int64
    top_logprobs: torch.Tensor  # (B, K) float32


def apply_penalties(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    """(B, V) -> penalised copy (or ``logits`` itself when no row has a penalty).

    The rows with a penalty are penalised together: one (P, V) mask of tokens seen and
    one (P, V) count of output tokens, each scattered from one padded id matrix.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not idx:
        return logits
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[1]
    params = [rows[i].params for i in idx]
    sub = logits[idx]  # (P, V)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _id_matrix([rows[i].prompt_ids + rows[i].output_ids for i in idx], vocab, dev)
        hit = torch.zeros(len(idx), vocab + 1, dtype=torch.bool, device=dev)
        hit = hit.scatter_(1, seen, True)[:, :vocab]  # column ``vocab`` took the padding
        rep = _column([p.repetition_penalty for p in params], sub)
        sub = torch.where(hit, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        out = _id_matrix([rows[i].output_ids for i in idx], vocab, dev)
        counts = torch.zeros(len(idx), vocab + 1, dtype=sub.dtype, device=dev)
        counts = counts.scatter_add_(1, out, torch.ones_like(out, dtype=sub.dtype))[:, :vocab]
        freq = _column([p.frequency_penalty for p in params], sub)
        presence = _column([p.presence_penalty for p in params], sub)
        sub = sub - (freq * counts + presence * (counts > 0).to(sub.dtype))
    logits[idx] = sub
    return logits


def _id_matrix(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Ragged token ids -> (P, max len) int64, padded with ``vocab`` (a column past the end)."""
    width = max(1, max(len(x) for x in ids))
    padded = [x + [vocab] * (width - len(x)) for x in ids]
    return torch.tensor(padded, dtype=torch.long, device=device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """(P,) host floats -> a (P, 1) column in ``like``'s dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(S, V) penalised logits of sampled rows -> (S, V) probabilities after all filters.

    Only rows that ask for top-p are sorted (the whole vocabulary, as top-p needs); rows
    that ask for top-k alone keep the logits at or above their k-th largest (``topk``, no
    sort); other rows are not ranked at all.
    """
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    top_k = [i for i, p in enumerate(params) if p.top_k > 0 and p.top_p >= 1.0]
    if top_k:
        ks = [min(params[i].top_k, vocab) for i in top_k]
        logits[top_k] = _top_k_only(logits[top_k], ks)
    if top_p:
        logits[top_p] = _top_k_top_p(logits[top_p], [params[i] for i in top_p])
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        floor = min_ps * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_only(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """(R, V), k per row -> logits below each row's k-th largest set to -inf (ties stay)."""
    top = logits.topk(max(ks), dim=-1).values  # (R, max k), descending
    k = torch.tensor(ks, device=logits.device).unsqueeze(1)
    kth = top.gather(1, k - 1)  # (R, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(R, V) rows that ask for top-p (and maybe top-k): one sort of each row."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of higher-ranked tokens
    top_ps = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
    # The top token always survives: its preceding mass is 0 < top_p.
    sorted_logits = sorted_logits.masked_fill(before >= top_ps, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def uniform(seed: int, position: int) -> float:
    """A seeded row's uniform in [0, 1): the top 53 bits of ``mix_seed``."""
    return (mix_seed(seed, position) >> 10) * 2.0**-53


def draw(
    probs: torch.Tensor, rows: list[SampleRequest], generator: torch.Generator
) -> torch.Tensor:
    """(S, V) probabilities -> (S,) token ids: the first token whose cumulative mass
    exceeds ``u`` times the row's total.

    One uniform a row, where a race of noisy scores needs one a token: ``sample`` of 5
    rows of a 49k vocabulary at a temperature takes 0.3 ms instead of 1.7 on one thread,
    what a speculative verification of 4 drafts pays each step. The cumulative sum runs
    in float64 and row by row (a sequential scan on CPU), so a seeded row comes out the
    same token whatever batch it is in.
    """
    s = probs.shape[0]
    u = torch.empty(s, dtype=torch.float64, device=probs.device)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        u[unseeded] = torch.rand(
            len(unseeded), dtype=torch.float64, generator=generator, device=probs.device
        )
    seeded = [
        (i, uniform(r.params.seed, len(r.output_ids)))
        for i, r in enumerate(rows)
        if r.params.seed is not None
    ]
    if seeded:
        index, values = zip(*seeded, strict=True)
        u[list(index)] = torch.tensor(values, dtype=torch.float64, device=probs.device)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (S, V), non-decreasing
    # NOTE: u <= 1 - 2^-53, so u * total rounds to below the total (never up to it): some
    # cdf entry exceeds it, and the first that does belongs to a token of nonzero mass (a
    # filtered token adds nothing to the sum and can never be the first to pass).
    target = u.unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # NOTE: a row with no mass (a grammar mask that allowed nothing: softmax of all -inf
    # is NaN) would land at V, past the vocabulary. It gets the last id instead, which
    # its grammar refuses, and that ends the request (runtime/step_output.py).
    return picked.clamp_(max=probs.shape[1] - 1)


def sample(
    logits: torch.Tensor,
    rows: list[SampleRequest],
    generator: torch.Generator,
    constrain: Constraint | None = None,
) -> SampleOutput:
    """logits: (B, V) float32 -> one token per row, with logprobs where asked.

    ``constrain`` masks disallowed tokens of a (B, V) tensor in place (a grammar); it may
    mask ``logits`` itself, which the caller must not read again.
    """
    b = logits.shape[0]
    penalised = apply_penalties(logits, rows)
    wants_logprobs = any(r.params.logprobs is not None for r in rows)
    if constrain is not None:
        # NOTE: ``logits`` itself is masked only when no row reads raw logprobs from it
        # below (a (B, V) copy costs more than the mask); the caller's logits are spent.
        if penalised is logits and wants_logprobs:
            penalised = penalised.clone()
        constrain(penalised)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    every = len(sampled) == b  # then no (B, V) argmax nor row gather to throw away
    token_ids = (
        torch.empty(b, dtype=torch.long, device=logits.device)
        if every
        else penalised.argmax(dim=-1)
    )
    if sampled:
        picked = penalised if every else penalised[sampled]
        probs = filtered_probs(picked, [rows[i].params for i in sampled])
        token_ids[sampled] = draw(probs, [rows[i] for i in sampled], generator)
    k = max((r.params.logprobs or 0 for r in rows), default=0)
    logprobs = torch.full((b,), float("nan"), device=logits.device)
    top_ids = torch.zeros((b, k), dtype=torch.long, device=logits.device)
    top_logprobs = torch.zeros((b, k), device=logits.device)
    if wants_logprobs:
        raw = logits.float().log_softmax(dim=-1)
        wanted = torch.tensor([r.params.logprobs is not None for r in rows], device=logits.device)
        chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        logprobs = torch.where(wanted, chosen, logprobs)
        if k:
            top_logprobs, top_ids = raw.topk(k, dim=-1)
    return SampleOutput(token_ids, logprobs, top_ids, top_logprobs)
