"""Token choice for batched generation that does not depend on the batch.

A sampled reply must be a function of its request alone (seed, conversation, turn, sample), not of
which other requests shared its decode steps or how many processes ran: a resumed or re-sharded
run then writes the same replies. So no stateful generator is consumed in batch order. Each
request carries a 63-bit key, and the uniform for its t-th reply token is a hash of (key, t)
(splitmix64 finalizer in int64 arithmetic, on the device, inside the decode graph). The token is
drawn by inverting the CDF of the filtered distribution at that uniform: one random number per row
per step, and an exact draw from the distribution.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax); otherwise softmax(logits / temperature) restricted to the
    top_k most likely tokens (0 = all) and to the smallest set whose mass reaches top_p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_key(*parts: int) -> int:
    """A stable 63-bit key from integers (the same in every process, run and platform)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) for each (key, step): splitmix64 of key + (step + 1) * golden ratio, top 24
    bits (exactly representable in float32). int64 products wrap, which is what the mix wants."""
    z = keys + (steps + 1) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities [..., vocab] of the distribution `params` samples from (not greedy):
    softmax(logits / temperature) over the top_k likeliest tokens, then over the smallest set of the
    likeliest whose mass reaches top_p, renormalised. Speculative sampling filters drafter and target
    through this same function, which its rejection rule needs to be exact."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the more likely tokens
        ordered = ordered.masked_fill(before >= params.top_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_tokens(
    logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The next token of each row ([b] int64) from logits [b, vocab]; row r's draw depends on its
    logits, keys[r] and steps[r] only. No host synchronisation (CUDA-graph safe)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    cdf = torch.cumsum(filtered_probs(logits, params), dim=-1)
    target = uniforms(keys, steps).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
