"""DFlash speculative decoding (batch 1) and the plain target-only baseline, greedy or sampled.

Each step the drafter drafts one block: position 0 is the last token the target produced, the other
B-1 positions are mask tokens; the drafter sees the target's features of every accepted token
through its context KV cache. The target then verifies the whole block in one forward. Greedy: the
longest prefix of drafts equal to the target's own argmax is accepted, plus the target's next token,
so the output is exactly the target's greedy output (lossless). Sampled: standard speculative
sampling (accept draft x with probability min(1, p(x)/q(x)), resample the first rejected position
from max(0, p - q)), so the output has the target's sampling distribution.

DFlash-2 drafters (a candidate selector) draft the selector's path instead of each position's argmax
or sample: greedy, its argmax path; sampled, a path drawn position by position from the selector's
softmax over the candidates, which is then the q of the rejection rule (as in the reference).

Step counting follows the reference (z-lab `dflash` 0.1.0 `dflash_generate`): the last block only
drafts as many tokens as are left, a step counts the tokens it adds to the output (none past
`max_new_tokens`, none after a stop token), and the first token, from the prompt's forward, is no step.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from dflash_pipeline.shared.generation.sampling import SamplingParams, filtered_probs
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache
from dflash_pipeline.shared.target.loading import HiddenStateCapture


@dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded)
    seconds: float
    accepted: list[int] = field(default_factory=list)  # tokens added to the output per target verify step

    @property
    def tau(self) -> float:
        """Mean tokens per target forward in decoding (accepted drafts + the bonus token)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


GREEDY = SamplingParams()


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of non-negative (not necessarily normalised) weights."""
    return torch.multinomial(weights.reshape(-1, weights.shape[-1]), 1, generator=generator).reshape(weights.shape[:-1])


def _next_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    return int(logits.argmax() if sampling.greedy else _draw(filtered_probs(logits, sampling), generator))


def _speculative_sample(
    drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """(accepted drafts, the token after them) by the rejection rule; `drafts` [n] were drawn from
    `q` [n, V], `p` [n+1, V] are the target's filtered probabilities after each block position."""
    n = len(drafts)
    rows = torch.arange(n, device=drafts.device)
    u = torch.rand(n, device=drafts.device, generator=generator)
    n_ok = int((u * q[rows, drafts] < p[rows, drafts]).int().cumprod(0).sum())
    if n_ok == n:
        return n, int(_draw(p[n], generator))
    residual = (p[n_ok] - q[n_ok]).clamp_min(0)
    return n_ok, int(_draw(residual if residual.sum() > 0 else p[n_ok], generator))


def _selector_draft(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    lm_head: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A DFlash-2 block's drafts [L] (`propose` on the block's hidden states [1, L, H] after `anchor`
    [1]) and, sampled, the distribution q [L, V] they were drawn from, as the reference's
    `dflash_generate` and `_rejection_sample` use it: each position's softmax(selector scores / T)
    over its k candidates (no top-k / top-p of the sampling settings: those filter the target's p
    only), zero off the candidates. The candidates of a position are distinct (top-k), so q(x) and
    p - q are exactly the reference's masked sum and scatter-add."""
    path, candidates, probs = drafter.propose(hidden, anchor, lm_head.to(hidden.dtype), sampling.temperature, generator)
    if sampling.greedy:
        return path[0], None
    q = torch.zeros(probs.shape[1], lm_head.shape[0], dtype=probs.dtype, device=probs.device)
    return path[0], q.scatter_(-1, candidates[0], probs[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stop_at(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def cache_kwarg(target: nn.Module) -> str:
    """Name of the forward's KV-cache argument: `cache` in newer transformers (5.24 warns on
    `past_key_values`, removed in 5.40), `past_key_values` in older ones (5.17 has no `cache`)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop cached positions from `length` on. A negative `crop` argument means "remove this many"
    in every transformers version we support (the meaning of a positive one changed in 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def target_generate(
    target: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
) -> Generation:
    """Target-only decoding with a KV cache: the baseline and the reference output."""
    device = prompt.device
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    kv = {cache_kwarg(target): cache}
    out = target(input_ids=prompt[None], **kv, use_cache=True, logits_to_keep=1)
    tokens = [_next_token(out.logits[0, -1], sampling, generator)]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        out = target(input_ids=torch.tensor([[tokens[-1]]], device=device), **kv, use_cache=True)
        tokens.append(_next_token(out.logits[0, -1], sampling, generator))
    _sync(device)
    return Generation(tokens, time.perf_counter() - start)


@torch.inference_mode()
def dflash_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    capture: HiddenStateCapture,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    block_size: int | None = None,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
) -> Generation:
    """Speculative decoding of one prompt; `capture` hooks the drafter's target layers."""
    device = prompt.device
    embed = target.get_input_embeddings()
    lm_head = target.get_output_embeddings().weight
    mask_id = drafter.config.mask_token_id
    scale = drafter.config.input_embedding_scale
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    kv = {cache_kwarg(target): cache}
    out = target(input_ids=prompt[None], **kv, use_cache=True, logits_to_keep=1)
    features = torch.cat(capture.take(), dim=-1)  # [1, P, n_layers*H]
    feature_positions = torch.arange(len(prompt), device=device)[None]
    tokens = [_next_token(out.logits[0, -1], sampling, generator)]
    draft_cache = DrafterCache()
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        left = max_new_tokens - len(tokens)
        size = min(block_size or drafter.config.block_size, left + 1)  # the last block drafts only what is left
        seen = len(prompt) + len(tokens) - 1  # tokens with target features: all but the last
        block = torch.full((1, size), mask_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        positions = torch.arange(seen, seen + size, device=device)[None]
        hidden = drafter.forward_step(
            features.to(drafter.fc.weight.dtype),
            feature_positions,
            embed(block).to(drafter.fc.weight.dtype) * scale,
            positions,
            draft_cache,
        )
        if drafter.candidate_selector is not None:  # DFlash-2: the selector's path after the anchor
            block[0, 1:], q = _selector_draft(drafter, hidden[:, 1:], block[:, 0].clone(), lm_head, sampling, generator)
        else:
            draft_logits = drafter.compute_logits(hidden[:, 1:], lm_head.to(hidden.dtype))[0]
            if sampling.greedy:
                block[0, 1:] = draft_logits.argmax(-1)
            else:
                q = filtered_probs(draft_logits, sampling)
                block[0, 1:] = _draw(q, generator)
        out = target(input_ids=block, **kv, use_cache=True)
        drafts = block[0, 1:]
        if sampling.greedy:
            verified = out.logits[0].argmax(-1)  # target's next token after each block position
            n_ok = int((drafts == verified[:-1]).int().cumprod(0).sum())
            following = int(verified[n_ok])
        else:
            n_ok, following = _speculative_sample(drafts, filtered_probs(out.logits[0], sampling), q, generator)
        # a step counts only what it adds: nothing past the limit, nothing after a stop token
        new = _stop_at((drafts[:n_ok].tolist() + [following])[:left], stop_ids)
        accepted.append(len(new))
        tokens.extend(new)
        if len(new) <= n_ok or new[-1] in stop_ids:  # cut short: decoding is over
            break
        truncate_cache(cache, seen + 1 + n_ok)  # keep the block positions that were accepted
        step_features = torch.cat(capture.take(), dim=-1)
        features = step_features[:, : 1 + n_ok]
        feature_positions = positions[:, : 1 + n_ok]
    _sync(device)
    return Generation(tokens, time.perf_counter() - start, accepted)
