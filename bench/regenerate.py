"""Reply regeneration throughput on one GPU: the continuous-batching engine against HF `generate`, same run.

`dflash-extract --regenerate` rewrites every assistant reply with the target's own. Contenders:
- engine: `dflash_pipeline.shared.generation` (continuous batching, paged KV cache, CUDA-graph decode) at
  `--batch` concurrent requests (repeatable), greedy (and temperature 1 / top-p 0.95 with `--sampled`);
- HF: the previous path, `model.generate` on static, prompt-length-sorted, left-padded batches
  (`--baseline-batch`, repeatable: 32, the old default, and 256), greedy. It is slow, so it runs on the
  first `--baseline-requests` requests with replies capped at `--baseline-max-new-tokens`; its rate
  is the comparison (the cap shortens its contexts, which flatters it slightly).
Workload (seeded): random prompt ids (no special ids), prompt lengths in [64, 1024] with mean ~300,
reply lengths in [1, 1024] with mean ~500, both clipped log-normals. A request's drawn reply length is
its `max_new_tokens` and nothing stops it earlier (engine: no stop ids; HF: a logits processor bans
the eos id before the drawn length and forces it there), so requests end unevenly, like chat replies,
and every contender generates exactly the drawn tokens. Rates count those useful tokens per wall
second (prefill included) after a short warm-up call.
Real conversations (`--chat FILE` with `--target`): the first `--requests` records of FILE (.jsonl,
or .jsonl.xz as bench/quality_scale.py packs them) go through `dflash-extract --regenerate`'s own
path (`regenerate_records`, the target's chat template, `--chat-temperature`, `--max-reply` new
tokens), once per `--reuse-prefixes` and `--kv-cache-dtype` value: generated tok/s, prompt tokens
prefilled and cached, and how many conversations came out identical. `--score-replies` also scores
every row's reply tokens by the target in float32 (bench/reply_scoring.py: the share that are its
argmax, their NLL) and compares its replies with the first row's: what a lossy KV cache does to the
data. Then nothing else runs.
Schedule replay (`--replay-pages N`): the engine's own admission, paging and reuse decisions over
the workload, with a decoder that computes nothing (its logits are zeros, and nothing stops a reply
early, so the schedule depends on the lengths alone), on a pool of N pages (a GPU run's
`kv_cache_pages` for its model's dtype; an fp8 KV cache's rows get 2N, as the engine fits twice the
pages in the same memory): prefills, prompt tokens, decode steps and rows per knob setting, on any machine,
in seconds. Then nothing else runs. `--replay-cost` also models each schedule's time on the GPU
(`schedule_cost`: decode steps at their roofline over a measured efficiency, prefill at a measured
rate; defaults from run 6 on the H200, which it reproduces) to choose what a GPU run should try.
Prefill is charged per token only: the small prefills of multi-turn schedules cost more per token.
Multi-turn chat (`--turns N`, engine only): each of the `--requests` conversations asks N times; turn
t's prompt is turn t-1's prompt, its reply and a new user turn (lengths in [8, 512], mean
`--mean-user-turn`), as a chat template lays them out. `--reuse-prefixes on --reuse-prefixes off`
runs the engine with each later turn computing only what its cached conversation lacks, and with
every turn prefilling its whole conversation again, in one run.
Physical bound, measured in the same run: device-to-device copy bandwidth (bytes read + written). A
decode step at batch B reads the weights once (the input embedding table excluded: only B rows of it
are gathered) and each row's KV cache: bound tok/s = B / ((weights + B * mean_context * kv_per_token)
/ bandwidth), mean_context = the engine's kv_tokens_read / decode_rows. A second bound charges the
engine's actual schedule (its under-full tail steps too): (decode_steps * weights + kv_tokens_read *
kv_per_token) / bandwidth. Both leave prefill out and charge bytes only. A third, the roofline, adds the
matmuls at the rate of a large matmul measured in the same run (2 FLOPs per weight a token goes
through): per the engine's steps, max(matmuls of the rows, weights read) + KV reads, plus prefill's
matmuls (`roofline_s`). At hundreds of rows a step's matmuls outlast its weight read, and prefill is
compute-bound, so the bytes-only bounds sit below what any engine can reach (bench/RESULTS.md run 11).
Also printed: an end-to-end estimate for the paper's recipe (regeneration at the measured rates;
extraction and training rates from bench/RESULTS.md, overridable).

    python -m bench.regenerate --json result.json                      # GPU: Qwen3-8B shape, random bf16
    python -m bench.regenerate --shape tiny --requests 64              # CPU: the repo's tiny target
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import LogitsProcessor

from bench import emit

# Measured numbers from bench/RESULTS.md (one H200), the defaults of the recipe estimate's options.
RESULTS_EXTRACT_TOK_S = 42_582  # stage one: pipeline, compiled layers, 4 write streams (2026-12-03)
RESULTS_TRAIN_STEP_S = 0.122  # stage two: compiled flex step, 5-layer drafter (run D, 2026-12-04)
RESULTS_TRAIN_STEP_TOKENS = 4096  # ... one 4096-token pack per step
TRAIN_EPOCHS = 6  # dflash-train's default --epochs

QWEN3_FIRST_SPECIAL_ID = 151_643  # <|endoftext|>; Qwen3's special/added ids are 151643 and above
QWEN3_IM_END_ID = 151_645
WARM_KEY = 1 << 40  # keys of warm-up requests (timed requests use their index)
NOT_COUNTERS = {"kv_cache_pages", "page_size", "kv_cache_dtype"}  # engine.stats entries that are settings, not counters


# ------------------------------------------------------------------ model


def qwen3_8b_shape_config():
    """Qwen3-8B's shape: hidden 4096, 36 layers, 32/8 heads x 128, MLP 12288, vocab 151936, untied head,
    rope theta 1e6, 40960 positions."""
    from bench.extract import qwen3_8b_config

    cfg = qwen3_8b_config(36)
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict):  # transformers 5
        rope["rope_theta"] = 1e6
    else:
        cfg.rope_theta = 1e6
    cfg.bos_token_id, cfg.eos_token_id = QWEN3_FIRST_SPECIAL_ID, QWEN3_IM_END_ID
    return cfg


def special_free_ids(tokenizer, vocab: int) -> np.ndarray:
    """Token ids a prompt may hold: the tokenizer's, minus its special and added tokens."""
    bad = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = np.arange(min(len(tokenizer), vocab))
    return ids[~np.isin(ids, sorted(bad))]


def load_model(args, device: torch.device, dtype: torch.dtype):
    """(model, ids prompts may use, eos id for the HF baseline, description)."""
    from transformers import AutoModelForCausalLM

    if args.target:
        from dflash_pipeline.shared.target.assets import load_tokenizer
        from dflash_pipeline.shared.target.loading import load_full_target

        model = load_full_target(args.target, device=device, dtype=dtype)
        tokenizer = load_tokenizer(args.target)
        allowed = special_free_ids(tokenizer, model.config.vocab_size)
        what = f"{args.target} ({dtype_name(dtype)})"
    elif args.shape == "qwen3-8b":
        cfg = qwen3_8b_shape_config()
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model.eval().requires_grad_(False)
        allowed = np.arange(QWEN3_FIRST_SPECIAL_ID)
        what = f"Qwen3-8B shape, random {dtype_name(dtype)} weights"
        return model, allowed, QWEN3_IM_END_ID, what
    else:
        from transformers import AutoTokenizer

        from dflash_pipeline.data.tiny_target import build_tiny_target

        with tempfile.TemporaryDirectory() as tmp:
            build_tiny_target(tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
        model = model.eval().requires_grad_(False).to(device)
        allowed = special_free_ids(tokenizer, model.config.vocab_size)
        what = f"tiny random Qwen3 target ({dtype_name(dtype)})"
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = int(
            next(iter(sorted(set(range(model.config.vocab_size)) - set(allowed.tolist()))), model.config.vocab_size - 1)
        )
    return model, allowed, int(eos), what


def qwen3_8b_shape_bytes() -> dict:
    """`model_bytes` of the Qwen3-8B shape in bf16, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen3_8b_shape_config(), dtype=torch.bfloat16)
    return model_bytes(model)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_bytes(model) -> dict:
    """Parameter bytes (a tied embedding counted once) and the part a decode step reads: all but the
    input embedding table, of which a step only gathers one row per sequence (a tied table is the LM
    head too, read whole, so it stays)."""
    from dflash_pipeline.shared.target.loading import text_config

    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups tied weights
    numel = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb  # identity: meta tensors all have data_ptr 0
    emb_bytes = emb.numel() * emb.element_size()
    cfg = text_config(model.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
    return {
        "weight_bytes": total,
        "embedding_bytes": emb_bytes,
        "tied_embedding": tied,
        "weight_bytes_read_per_step": total if tied else total - emb_bytes,
        "kv_bytes_per_token": kv,
        # two FLOPs (multiply, add) per weight a token goes through: every one a step reads
        "matmul_flops_per_token": 2 * (numel if tied else numel - emb.numel()),
    }


# ------------------------------------------------------------------ workload


def draw_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, mean: float, sigma: float) -> np.ndarray:
    """n integers in [lo, hi] from a clipped log-normal whose median is set (bisection on these very
    draws) so that their mean is `mean` (as near as rounding and the clip allow)."""
    z = rng.standard_normal(n)

    def lengths(mu: float) -> np.ndarray:
        return np.clip(np.rint(np.exp(mu + sigma * z)), lo, hi).astype(np.int64)

    a, b = math.log(max(lo, 1)) - 6 * sigma, math.log(hi) + 6 * sigma
    for _ in range(80):
        mid = (a + b) / 2
        a, b = (mid, b) if lengths(mid).mean() < mean else (a, mid)
    return lengths((a + b) / 2)


Conversation = list[tuple[list[int], int]]  # turns: (new prompt ids, reply length)


def draw_workload(args, allowed: np.ndarray) -> list[Conversation]:
    """`args.requests` conversations of `args.turns` turns: the first turn's ids are the prompt, a
    later turn's the user's new message (see the module doc)."""
    rng = np.random.default_rng(args.seed)
    n, later = args.requests, args.requests * (args.turns - 1)
    prompt_lens = draw_lengths(rng, n, args.min_prompt, args.max_prompt, args.mean_prompt, 0.7)
    reply_lens = draw_lengths(rng, n * args.turns, 1, args.max_reply, args.mean_reply, 0.9)
    user_lens = draw_lengths(rng, later, 8, 512, args.mean_user_turn, 0.9) if later else np.zeros(0, np.int64)
    firsts = [allowed[rng.integers(0, len(allowed), int(L))].tolist() for L in prompt_lens]
    users = [allowed[rng.integers(0, len(allowed), int(L))].tolist() for L in user_lens]
    t = args.turns
    return [
        [(firsts[c] if k == 0 else users[c * (t - 1) + k - 1], int(reply_lens[c * t + k])) for k in range(t)]
        for c in range(n)
    ]


def converse(engine, conversations: list[Conversation], keep: bool = True, rewrite: bool = False, seed: int = 0):
    """The conversations through `engine` as chat runs them: turn t asks with turn t-1's prompt + its
    reply + the turn's new ids (`rewrite`: only the first half of the reply, as templates that drop
    parts of earlier replies do), each reply at most the turn's length; `keep`: every turn but the
    last keeps its cache for the next. Returns the prompts asked and the replies, per conversation."""
    from dflash_pipeline.shared.generation.engine import Request
    from dflash_pipeline.shared.generation.sampling import request_key

    asked: list[list[list[int]]] = [[] for _ in conversations]
    replies: list[list] = [[] for _ in conversations]

    def ask(c: int) -> None:
        t = len(replies[c])
        new, length = conversations[c][t]
        reply = replies[c][-1].tokens if t else []
        prompt = (asked[c][-1] if t else []) + (reply[: len(reply) // 2] if rewrite else reply) + new
        asked[c].append(prompt)
        last = t + 1 == len(conversations[c])
        engine.add(c, Request(prompt, length, key=request_key(seed, c, t), keep_cache=keep and not last))

    for c in range(len(conversations)):
        ask(c)
    while engine.pending:
        for c, reply in engine.step():
            replies[c].append(reply)
            if len(replies[c]) < len(conversations[c]):
                ask(c)
    return asked, replies


def chat_records(path: Path, n: int) -> list:
    """The first `n` records of a .jsonl or .jsonl.xz file, as (input index, Record) pairs."""
    import lzma
    from itertools import islice

    from dflash_pipeline.data.records import iter_records

    with tempfile.TemporaryDirectory() as tmp:
        if path.suffix == ".xz":
            plain = Path(tmp) / path.stem
            plain.write_bytes(lzma.decompress(path.read_bytes()))
            path = plain
        return [(r.index, r) for r in islice(iter_records(path), n)]


def run_chat(model, tokenizer, records: list, batch: int, knobs: dict, kv_cache_dtype: str, args) -> tuple[dict, list]:
    """One `regenerate_records` pass over real conversations (module doc) with the KV cache
    `kv_cache_dtype` ("auto" or lossy): the row, and every record's messages as regenerated."""
    from dflash_pipeline.extract.regenerate import RegenerateSettings, regenerate_records
    from dflash_pipeline.shared.generation.engine import EngineSettings

    settings = RegenerateSettings(
        max_new_tokens=args.max_reply, temperature=args.chat_temperature, seed=args.seed, kv_cache_dtype=kv_cache_dtype
    )
    engine = EngineSettings(max_batch=batch, page_size=args.page_size, **knobs)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        out, stats, timing = regenerate_records(
            records,
            lambda: model,
            tokenizer,
            settings,
            max_length=args.chat_max_length,
            cache=Path(tmp) / "cache.jsonl",
            engine=engine,
        )
        wall = time.perf_counter() - t
    row = {
        "contender": "regenerate_records",
        "batch": batch,
        **knobs,
        "kv_cache_dtype": kv_cache_dtype,
        "temperature": args.chat_temperature,
        "conversations": stats.conversations,
        "replies": stats.replies,
        "generated_tokens": timing.tokens,
        "unfinished": stats.unfinished,
        "seconds": timing.seconds,
        "wall_seconds": wall,
        "tokens_per_s": timing.tokens / timing.seconds if timing.seconds else float("nan"),
        "prefilled_tokens": timing.prefilled_tokens,
        "cached_tokens": timing.cached_tokens,
    }
    return row, [r.messages for _, r in out]


class _NoComputeDecoder:
    """A PagedDecoder's interface with zero logits and no work: what the engine schedules is then
    visible without the model's cost (`--replay-pages`). Records each call's size for costing:
    `steps` (rows, context tokens read) per decode step, `prefills` (tokens computed, prompts) per prefill."""

    def __init__(self, cache, vocab: int):
        self.cache, self.vocab = cache, vocab
        self.steps: list[tuple[int, int]] = []
        self.prefills: list[tuple[int, int]] = []

    def prefill(self, tokens, positions, cache_index, lengths, context_index=None, context_lengths=None):
        self.prefills.append((len(tokens), len(lengths)))
        return torch.zeros(len(lengths), self.vocab)

    def decode(self, tokens, positions, block_table):
        self.steps.append((len(tokens), int((positions + 1).sum())))
        return torch.zeros(len(tokens), self.vocab)


def replay_schedule(model, conversations: list[Conversation], batch: int, knobs: dict, pages: int, args) -> dict:
    """The engine's schedule of the conversations on a pool of `pages` pages (module doc)."""
    from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine
    from dflash_pipeline.shared.generation.sampling import SamplingParams

    settings = EngineSettings(
        max_batch=batch,
        max_request_tokens=max(sum(len(new) + L for new, L in c) for c in conversations),
        page_size=args.page_size,
        num_pages=pages,
        cuda_graphs=False,
        compile=False,
        **knobs,
    )
    engine = GenerationEngine(model, stop_ids=[], sampling=SamplingParams(), settings=settings)
    decoder = engine.decoder = _NoComputeDecoder(engine.decoder.cache, model.config.vocab_size)
    converse(engine, conversations)
    st = engine.stats
    keys = ("prefills", "prefill_tokens", "reused_prompt_tokens", "decode_steps", "kv_tokens_read", "evicted_caches")
    row = {"batch": batch, **knobs, **{k: st[k] for k in keys}, "mean_rows": st["decode_rows"] / st["decode_steps"]}
    if args.replay_cost:
        row["cost"] = schedule_cost(
            decoder.steps, decoder.prefills, batch, settings.graph_bucket_step, settings.kv_cache_dtype, args
        )
    return row


def schedule_cost(
    steps: list[tuple[int, int]],
    prefills: list[tuple[int, int]],
    batch: int,
    bucket_step: int,
    kv_cache_dtype: str | None,
    args,
) -> dict:
    """A replayed schedule's time on the GPU of a run whose rates are given (`--cost-*`, default run
    6's on the H200): each decode step serially at its roofline, max(matmul of its rows padded to the
    graph bucket at the peak rate, weight read) + its rows' KV reads, over the measured share of that
    roofline a step reaches (`--cost-step-efficiency`); each prefill at the measured prompt rate. The
    sizes are the Qwen3-8B shape's, whatever model replayed the schedule."""
    from dflash_pipeline.shared.generation.engine import graph_buckets

    sizes = with_kv_cache_dtype(qwen3_8b_shape_bytes(), kv_cache_dtype or "bfloat16", "bfloat16")
    buckets = graph_buckets(batch, bucket_step)
    bw, peak = args.cost_bandwidth, args.cost_peak_flops
    roofline = sum(
        roofline_s(1, next(b for b in buckets if b >= rows), context, 0, sizes, bw, peak) for rows, context in steps
    )
    decode_s = roofline / args.cost_step_efficiency
    prefill_s = sum(tokens for tokens, _ in prefills) / args.cost_prefill_tok_s
    decoded = sum(rows for rows, _ in steps)
    generated = decoded + sum(requests for _, requests in prefills)  # a prefill yields each prompt's first token
    mean_context = sum(c for _, c in steps) / decoded
    bound = bound_tok_s(batch, mean_context, sizes, bw)
    tok_s = generated / (decode_s + prefill_s)
    return {
        "decode_roofline_s": roofline,
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "tok_s": tok_s,
        "bound_tok_s": bound,
        "of_bound": tok_s / bound,
    }


def first_turns(conversations: list[Conversation]) -> tuple[list[list[int]], list[int]]:
    """Prompts and reply lengths of the conversations' first turns (what the single-turn contenders run)."""
    return [c[0][0] for c in conversations], [c[0][1] for c in conversations]


# ------------------------------------------------------------------ physical bound


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall seconds of `work()` over `repeats` runs after three warm-up runs, the device
    synchronized around each."""
    for _ in range(3):
        work()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of a large tensor (median of
    `repeats` copies): the memory bandwidth a decode step can use."""
    nbytes = (2 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, repeats)


def with_kv_cache_dtype(sizes: dict, cache_dtype: str, model_dtype: str) -> dict:
    """`sizes` with the KV bytes of a cache held in `cache_dtype` instead of the model's dtype."""
    ratio = getattr(torch, cache_dtype).itemsize / getattr(torch, model_dtype).itemsize
    return {**sizes, "kv_bytes_per_token": int(sizes["kv_bytes_per_token"] * ratio)}


def bound_tok_s(batch: float, mean_context: float, sizes: dict, bandwidth: float) -> float:
    """Decode tokens/s at `batch` rows, each attending over `mean_context` tokens, if each step only
    had to read the weights and those KV caches once at `bandwidth`."""
    step_bytes = sizes["weight_bytes_read_per_step"] + batch * mean_context * sizes["kv_bytes_per_token"]
    return batch / (step_bytes / bandwidth)


def matmul_rate(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul in `dtype` (median of `repeats`): the most a decode step's
    projections or a prefill can reach."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / median_seconds(lambda: a @ b, device, repeats)


def roofline_s(
    steps: int, rows: int, kv_tokens: int, prefill_tokens: int, sizes: dict, bandwidth: float, flops_rate: float
) -> float:
    """The least time for `steps` decode steps of `rows` rows in all, reading `kv_tokens` cached tokens,
    and for prefilling `prefill_tokens` prompt tokens: the matmuls at `flops_rate` but no faster than one
    read of the weights per step, then the KV reads at `bandwidth` (a step's attention and matmuls run one
    after the other: each needs the other's output), prefill's matmuls at `flops_rate`. For one step, that
    step's roofline; for many, max() of the sums is at most the sum of each step's max(): still a bound."""
    flops, weights = sizes["matmul_flops_per_token"], sizes["weight_bytes_read_per_step"]
    decode = (
        max(rows * flops / flops_rate, steps * weights / bandwidth)
        + kv_tokens * sizes["kv_bytes_per_token"] / bandwidth
    )
    return decode + prefill_tokens * flops / flops_rate


# ------------------------------------------------------------------ contenders


def stats_of_call(before: dict, after: dict) -> dict:
    """The engine's stats for one `generate` call: its counters accumulate over the engine's life, so
    after - before (settings such as the page count are copied)."""
    return {
        k: (v - before.get(k, 0) if k not in NOT_COUNTERS else v)
        for k, v in after.items()
        if isinstance(v, (int, float))
    }


def run_engine(model, conversations: list[Conversation], batch: int, sampled: bool, knobs: dict, args, device) -> dict:
    """One engine row; `knobs`: the EngineSettings fields that vary between rows (graph_bucket_step,
    reuse_prefixes, admit_page_fraction, admit_wait_steps)."""
    from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine, Request
    from dflash_pipeline.shared.generation.sampling import SamplingParams

    sampling = (
        SamplingParams(temperature=1.0, top_p=0.95, top_k=0)
        if sampled
        else SamplingParams(temperature=0.0, top_p=1.0, top_k=0)
    )
    graphs = {"auto": None, "on": True, "off": False}[args.cuda_graphs]
    capacity = max(sum(len(new) + L for new, L in c) for c in conversations)  # the last turn, whole
    settings = EngineSettings(
        max_batch=batch,
        max_request_tokens=args.max_request_tokens or capacity,
        page_size=args.page_size,
        cuda_graphs=graphs,
        **knobs,
    )
    prompts, lengths = first_turns(conversations)
    t = time.perf_counter()
    engine = GenerationEngine(model, stop_ids=[], sampling=sampling, settings=settings)
    build_s = time.perf_counter() - t
    n_warm = min(batch, len(prompts), args.warmup_requests)
    t = time.perf_counter()
    engine.generate(
        [Request(prompt=prompts[i], max_new_tokens=min(lengths[i], 8), key=WARM_KEY + i) for i in range(n_warm)]
    )
    sync(device)
    warm_call_s = time.perf_counter() - t
    before = dict(engine.stats)
    sync(device)
    t = time.perf_counter()
    _, said = converse(engine, conversations)
    sync(device)
    seconds = time.perf_counter() - t
    replies = [r for c in said for r in c]
    lengths = [L for c in conversations for _, L in c]
    generated = sum(len(r.tokens) for r in replies)
    stats = stats_of_call(before, dict(engine.stats))
    useful = sum(min(len(r.tokens), L) for r, L in zip(replies, lengths))
    row = {
        "contender": "engine",
        "batch": batch,
        "bucket_step": knobs["graph_bucket_step"],
        "reuse_prefixes": knobs["reuse_prefixes"],
        "admit_page_fraction": knobs["admit_page_fraction"],
        "admit_wait_steps": knobs["admit_wait_steps"],
        "kv_cache_dtype": engine.stats["kv_cache_dtype"],
        "sampling": "sampled" if sampled else "greedy",
        "conversations": len(conversations),
        "requests": len(replies),
        "drawn_tokens": sum(lengths),
        "generated_tokens": generated,
        "useful_tokens": useful,
        "length_mismatches": sum(len(r.tokens) != L for r, L in zip(replies, lengths)),
        "finished_by_stop": sum(bool(getattr(r, "finished", False)) for r in replies),
        "seconds": seconds,
        "tokens_per_s": useful / seconds,
        "engine_build_s": build_s,
        "warmup_call_s": warm_call_s,
        "graph_capture_s": engine.stats.get("warmup_seconds"),
        "stats": stats,
        "engine_stats_total": dict(engine.stats),
    }
    if stats.get("decode_steps"):
        row["mean_active_rows"] = stats["decode_rows"] / stats["decode_steps"]
    if stats.get("decode_rows"):
        row["mean_context"] = stats["kv_tokens_read"] / stats["decode_rows"]
    if stats.get("decode_seconds"):
        row["decode_tokens_per_s"] = stats["decode_rows"] / stats["decode_seconds"]
    row["_tokens"] = [list(c[0].tokens) for c in said[: args.compare_rows]]  # first turns, as HF runs them
    del engine, replies, said
    return row


def time_projections(model, rows: int, device, repeats: int = 20) -> dict:
    """A decode step's q/k/v and gate/up matmuls over every layer at `rows` rows: the engine's two
    fused matmuls per layer against the five separate ones (HF's modules, views of the same
    weights), each timed on the device over `repeats` steps. The gain the fused projections bring,
    apart from the rest of the step."""
    from dflash_pipeline.shared.generation.decoder import fuse_projections

    layers = model.model.layers
    groups = [
        [[a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]] for a, m in ((x.self_attn, x.mlp) for x in layers)
    ]
    fused = [[fuse_projections(g) for g in pair] for pair in groups]
    x = torch.randn(rows, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)

    def separate() -> None:
        for pair in groups:
            for group in pair:
                for module in group:
                    module(x)

    def together() -> None:
        for pair in fused:
            for f in pair:
                f(x)

    result = {"rows": rows, "layers": len(layers)}
    with torch.inference_mode():
        for name, fn in (("separate_ms", separate), ("fused_ms", together)):
            fn()
            sync(device)
            t = time.perf_counter()
            for _ in range(repeats):
                fn()
            sync(device)
            result[name] = (time.perf_counter() - t) / repeats * 1e3
    result["speedup"] = result["separate_ms"] / result["fused_ms"]
    return result


def decode_inputs(model, rows: int, context: int, args, device, kv_cache_dtype: str | None = None) -> tuple:
    """An eager (graph-free) decoder with a KV cache of `rows` rows, and one decode step's inputs:
    random tokens at position `context` with the rows' pages in a block table, (decoder, tokens,
    positions, block_table). The cache holds zeros: a step's time does not depend on the values."""
    from dflash_pipeline.shared.generation.decoder import pages_for
    from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine
    from dflash_pipeline.shared.generation.sampling import SamplingParams

    per_row = pages_for(context + 1, args.page_size)
    settings = EngineSettings(
        max_batch=rows,
        max_request_tokens=context + 1,
        page_size=args.page_size,
        cuda_graphs=False,
        num_pages=rows * per_row + 1,
        kv_cache_dtype=kv_cache_dtype,
    )
    decoder = GenerationEngine(model, stop_ids=[], sampling=SamplingParams(), settings=settings).decoder
    table = torch.arange(1, rows * per_row + 1, dtype=torch.int32, device=device).view(rows, per_row)
    tokens = torch.randint(0, model.config.vocab_size, (rows,), device=device)
    positions = torch.full((rows,), context, device=device)
    return decoder, tokens, positions, table


def time_overlap(model, rows: int, context: int, args, device, repeats: int = 10) -> dict:
    """Would two half-batches on two streams beat one batch? A decode step runs each layer's matmuls
    (compute-bound) and then its attention (memory-bound), one after the other. Here one step of
    `rows` rows at `context` cached tokens each is timed as the engine runs it, and as two decode
    calls of half the rows each, on one stream and then on two streams whose kernels the GPU may run
    side by side (one half's attention beside the other's matmuls), each replayed from one CUDA graph.
    `streams_gain` > 1 is what splitting the engine's step would buy. Off CUDA there are no streams
    or graphs: the three run eagerly one after the other."""
    half = rows // 2
    decoder, tokens, positions, table = decode_inputs(model, rows, context, args, device)
    a, b = slice(0, half), slice(half, 2 * half)

    def whole() -> None:
        decoder.decode(tokens, positions, table)

    def halves() -> None:
        decoder.decode(tokens[a], positions[a], table[a])
        decoder.decode(tokens[b], positions[b], table[b])

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def halves_on_two_streams() -> None:
        if side is None:
            return halves()
        side.wait_stream(torch.cuda.current_stream(device))
        decoder.decode(tokens[a], positions[a], table[a])
        with torch.cuda.stream(side):
            decoder.decode(tokens[b], positions[b], table[b])
        torch.cuda.current_stream(device).wait_stream(side)

    result = {"rows": rows, "half": half, "context": context}
    with torch.inference_mode():
        # the same work either way: each row's logits do not depend on the rows beside it
        split = torch.cat([decoder.decode(tokens[r], positions[r], table[r]) for r in (a, b)])
        result["halves_max_abs_diff"] = float(
            (split - decoder.decode(tokens, positions, table)[: 2 * half]).abs().max()
        )
        for name, fn in (("whole_ms", whole), ("halves_ms", halves), ("two_streams_ms", halves_on_two_streams)):
            for _ in range(3):  # compiles the layers' pointwise work for the half size too
                fn()
            sync(device)
            run = fn
            if device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                run = graph.replay
                run()
                sync(device)
            t = time.perf_counter()
            for _ in range(repeats):
                run()
            sync(device)
            result[name] = (time.perf_counter() - t) / repeats * 1e3
    result["streams_gain"] = result["whole_ms"] / result["two_streams_ms"]
    return result


def profile_prefill(model, conversations: list[Conversation], n: int, args, device) -> dict:
    """torch.profiler over one admission's prefill of the first `n` conversations' first prompts
    (each asks for one token, so the call is the prefill alone), after two unprofiled calls of the
    same shape (a warm-up, then one timed): where its time goes, by operator (self device time and
    self host time). With --turns > 1 the prefill is of their second turns, continued from the keys
    and values the first turns (replies of at most 16 tokens, unprofiled) left in the cache."""
    from torch.profiler import ProfilerActivity, profile

    from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine, Request
    from dflash_pipeline.shared.generation.sampling import SamplingParams

    firsts = [
        Request(prompt=c[0][0], max_new_tokens=1 if args.turns == 1 else min(c[0][1], 16)) for c in conversations[:n]
    ]
    settings = EngineSettings(
        max_batch=max(n, 1),
        max_request_tokens=max(sum(len(new) + L for new, L in c[:2]) for c in conversations[:n]) + 1,
        page_size=args.page_size,
        cuda_graphs=False,
    )
    engine = GenerationEngine(model, stop_ids=[], sampling=SamplingParams(), settings=settings)

    def requests() -> list:
        """The prompts to prefill; for second turns, first runs the first turns (ids 0..n-1, kept)."""
        if args.turns == 1:
            return firsts
        replies = engine.generate([Request(r.prompt, r.max_new_tokens, keep_cache=True) for r in firsts])
        return [Request([*r.prompt, *a.tokens, *c[1][0]], 1) for r, a, c in zip(firsts, replies, conversations)]

    def timed(batch: list) -> float:
        sync(device)
        t = time.perf_counter()
        engine.generate(batch)
        sync(device)
        return time.perf_counter() - t

    timed(requests())  # warm-up
    batch = requests()
    before = dict(engine.stats)
    unprofiled = timed(batch)
    prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    batch = requests()
    with profile(activities=activities) as prof:
        profiled = timed(batch)
    events = prof.key_averages()
    device_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"

    def top(key: str) -> list[dict]:
        rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[: args.profile_top]
        return [
            {
                "op": e.key,
                "calls": e.count,
                "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
            }
            for e in rows
        ]

    return {
        "prompts": n,
        "continued": args.turns > 1,
        "prompt_tokens": sum(len(r.prompt) for r in batch),
        "prefilled_tokens": prefilled,
        "seconds": profiled,
        "seconds_unprofiled": unprofiled,
        "by_device_time": top(device_key),
        "by_host_time": top("self_cpu_time_total"),
    }


def profile_decode(model, rows: int, context: int, args, device, kv_cache_dtype: str | None = None) -> dict:
    """One decode step of `rows` rows at `context` cached tokens each, eager (no CUDA graph, so the
    profiler sees every kernel): its unprofiled wall time, then torch.profiler's device time by
    kernel (CPU time by operator off CUDA). The step's device time against the graph step the engine
    runs shows what launches cost; its split (matmuls, attention, the rest) against the roofline
    shows where the step is slow (inputs: `decode_inputs`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    decoder, tokens, positions, table = decode_inputs(model, rows, context, args, device, kv_cache_dtype)

    def step() -> None:
        decoder.decode(tokens, positions, table)

    with torch.inference_mode():
        for _ in range(3):
            step()
        sync(device)
        t = time.perf_counter()
        for _ in range(5):
            step()
        sync(device)
        unprofiled = (time.perf_counter() - t) / 5
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    if device.type == "cuda":  # the kernels alone: an operator's self device time counts its kernels again
        events = [e for e in events if e.device_type == DeviceType.CUDA]
    events = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)
    device_ms = sum(getattr(e, key, 0) for e in events) / 1e3
    return {
        "rows": rows,
        "context": context,
        "kv_cache_dtype": dtype_name(decoder.cache.dtype),
        "seconds_unprofiled": unprofiled,
        "device_ms": device_ms,
        "by_device_time": [
            {"op": e.key, "calls": e.count, "self_device_ms": getattr(e, key, 0) / 1e3}
            for e in events[: args.profile_top]
        ],
    }


class EndAtDrawnLength(LogitsProcessor):
    """HF logits processor: row r gets the eos id banned before its drawn length and forced at it,
    so it stops exactly there, like a chat reply ending (without it, a random model never stops)."""

    def __init__(self, lengths: list[int], prompt_width: int, eos: int, vocab: int, device):
        self.lengths = torch.tensor(lengths, device=device)
        self.width = prompt_width
        self.eos = eos
        self.forced = torch.full((1, vocab), -math.inf, device=device)
        self.forced[0, eos] = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        at_end = (self.lengths == input_ids.shape[1] - self.width + 1)[:, None]  # this token is the last
        scores[:, self.eos] = -math.inf
        return torch.where(at_end, self.forced[:, : scores.shape[1]].to(scores.dtype), scores)


def hf_generate(model, prompts, lengths, batch: int, eos: int, device) -> tuple[int, int, list[list[int]]]:
    """The previous path: length-sorted, left-padded static batches through `model.generate`, greedy,
    each batch running until its longest row ends. (tokens generated, rows stopped elsewhere than at
    their drawn length, tokens of each row in request order)."""
    from transformers import GenerationConfig, LogitsProcessorList

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    vocab = model.get_output_embeddings().weight.shape[0]
    out_tokens: list[list[int]] = [[] for _ in prompts]
    generated = mismatched = 0
    for start in range(0, len(order), batch):
        chosen = order[start : start + batch]
        width = max(len(prompts[i]) for i in chosen)
        ids = torch.full((len(chosen), width), eos, dtype=torch.long)
        attention = torch.zeros((len(chosen), width), dtype=torch.long)
        for row, i in enumerate(chosen):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attention[row, width - len(prompts[i]) :] = 1
        want = [lengths[i] for i in chosen]
        config = GenerationConfig(
            max_new_tokens=max(want),
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        processor = EndAtDrawnLength(want, width, eos, vocab, device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=attention.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([processor]),
            )
        for i, toks in zip(chosen, out[:, width:].tolist()):
            n = toks.index(eos) + 1 if eos in toks else len(toks)  # up to and with the (forced) eos
            out_tokens[i] = toks[:n]
            generated += n
            mismatched += n != lengths[i]
    return generated, mismatched, out_tokens


def run_hf(model, prompts, lengths, batch: int, n_requests: int, cap: int, eos: int, device) -> dict:
    prompts, lengths = prompts[:n_requests], [min(L, cap) for L in lengths[:n_requests]]
    warm = min(batch, len(prompts), 4)
    hf_generate(model, prompts[:warm], [min(L, 4) for L in lengths[:warm]], batch, eos, device)
    sync(device)
    t = time.perf_counter()
    generated, mismatched, tokens = hf_generate(model, prompts, lengths, batch, eos, device)
    sync(device)
    seconds = time.perf_counter() - t
    useful = sum(min(len(x), L) for x, L in zip(tokens, lengths))
    return {
        "contender": "hf_generate",
        "batch": batch,
        "sampling": "greedy",
        "requests": len(prompts),
        "max_new_tokens_cap": cap,
        "drawn_tokens": sum(lengths),
        "generated_tokens": generated,
        "useful_tokens": useful,
        "length_mismatches": mismatched,
        "seconds": seconds,
        "tokens_per_s": useful / seconds,
        "_tokens": tokens,
    }


def greedy_agreement(engine_tokens: list[list[int]], hf_tokens: list[list[int]]) -> dict:
    """How far the engine's greedy replies follow HF's on the same prompts: the common prefix of each
    pair over the compared length (both minus their last token: HF's is a forced eos). Random weights
    in bf16 have near-tied logits, so some divergence is expected; float32 should agree closely."""
    common = compared = identical = 0
    for a, b in zip(engine_tokens, hf_tokens):
        n = min(len(a), len(b)) - 1
        if n <= 0:
            continue
        k = next((j for j in range(n) if a[j] != b[j]), n)
        common, compared, identical = common + k, compared + n, identical + (k == n)
    pairs = sum(min(len(a), len(b)) > 1 for a, b in zip(engine_tokens, hf_tokens))
    return {
        "rows": pairs,
        "identical_rows": identical,
        "common_prefix_fraction": common / compared if compared else None,
    }


# ------------------------------------------------------------------ recipe estimate


def recipe_estimate(args, engine_row: dict | None, old_rate: float | None, sizes: dict, bandwidth: float) -> dict:
    """Hours of each stage of the paper's recipe (one reply per conversation; stages in sequence).
    Measured in this run: the engine's and HF batch 32's regeneration rates (on this bench's workload).
    From bench/RESULTS.md (options): extraction tok/s per GPU, training step time and tokens per step.
    Modelled: the engine's rate moved to the recipe's longer replies by the ratio of the bandwidth
    bound at the recipe's mean context (prompt + reply / 2) to the bound at the context measured here."""
    C, R, P = args.recipe_conversations, args.recipe_reply_tokens, args.recipe_prompt_tokens
    tokens = C * (P + R)
    out = {
        "conversations": C,
        "reply_tokens": R,
        "prompt_tokens": P,
        "regen_gpus": args.recipe_regen_gpus,
        "extract_gpus": args.recipe_extract_gpus,
        "train_gpus": args.recipe_train_gpus,
        "epochs": args.recipe_epochs,
        "measured_here": ["regen_engine_tok_s_per_gpu", "regen_old_hf_batch32_tok_s_per_gpu"],
        "from_results_md": {
            "extract_tok_s_per_gpu": args.extract_tok_s,
            "train_step_s": args.train_step_s,
            "train_step_tokens": args.train_step_tokens,
        },
        "modelled": ["regen_engine_at_recipe_context_tok_s_per_gpu"],
    }
    out["extract_h"] = tokens / (args.extract_tok_s * args.recipe_extract_gpus) / 3600
    out["train_h"] = (
        args.recipe_epochs * tokens / args.train_step_tokens * args.train_step_s / args.recipe_train_gpus / 3600
    )
    rates = {"old_hf_batch32": old_rate}
    if engine_row:
        out["engine_batch"] = engine_row["batch"]
        rates["engine"] = engine_row["tokens_per_s"]
        if "mean_context" in engine_row:
            B = engine_row["batch"]
            scale = bound_tok_s(B, P + R / 2, sizes, bandwidth) / bound_tok_s(
                B, engine_row["mean_context"], sizes, bandwidth
            )
            rates["engine_at_recipe_context"] = engine_row["tokens_per_s"] * scale
    for name, rate in rates.items():
        if rate:
            out[f"regen_{name}_tok_s_per_gpu"] = rate
            out[f"regen_{name}_h"] = C * R / (rate * args.recipe_regen_gpus) / 3600
            out[f"total_{name}_h"] = out[f"regen_{name}_h"] + out["extract_h"] + out["train_h"]
    return out


# ------------------------------------------------------------------ main


def parse_args(argv=None):
    from dflash_pipeline.shared.generation.engine import LOSSY_KV_CACHE_DTYPES, EngineSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument(
        "--shape",
        choices=["qwen3-8b", "tiny"],
        default=None,
        help="random model: Qwen3-8B's shape in bf16 (default on CUDA) or the repo's tiny target (default on CPU)",
    )
    ap.add_argument("--target", default=None, help="a real model folder instead of --shape")
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="[default: bfloat16 on CUDA, float32 on CPU]",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="conversations (requests when --turns 1) [default: 2000 on CUDA, 64 on CPU]",
    )
    ap.add_argument(
        "--replay-pages",
        type=int,
        default=None,
        help="replay the engine's schedule on this many bf16 pages (module doc)",
    )
    c = ap.add_argument_group(
        "costing a replayed schedule on the GPU (--replay-cost; defaults: run 6, H200, bench/RESULTS.md)"
    )
    c.add_argument(
        "--replay-cost", action="store_true", help="also model each replayed schedule's GPU time (schedule_cost)"
    )
    c.add_argument("--cost-bandwidth", type=float, default=4.21e12, help="copy bandwidth, bytes/s")
    c.add_argument("--cost-peak-flops", type=float, default=790e12, help="bf16 matmul peak, FLOP/s")
    c.add_argument(
        "--cost-step-efficiency", type=float, default=0.776, help="measured decode time / its serial roofline (run 6)"
    )
    c.add_argument("--cost-prefill-tok-s", type=float, default=39_700, help="prompt tokens per prefill second")
    ap.add_argument("--chat", type=Path, default=None, help="real conversations (module doc; needs --target)")
    ap.add_argument("--chat-max-length", type=int, default=2048, help="--chat: dflash-extract's --max-length")
    ap.add_argument("--chat-temperature", type=float, default=0.0, help="--chat: dflash-extract's --temperature")
    ap.add_argument(
        "--score-replies",
        action="store_true",
        help="--chat: score each row's replies by the target in float32 against the first row's (module doc)",
    )
    ap.add_argument(
        "--turns", type=int, default=1, help="turns per conversation (module doc); HF runs first turns only"
    )
    ap.add_argument("--mean-user-turn", type=float, default=100.0, help="mean new tokens of a later turn's prompt")
    ap.add_argument(
        "--reuse-prefixes",
        choices=["on", "off"],
        action="append",
        default=None,
        help="engine prefix reuse across turns, repeatable: one engine run per value [default: on]",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *LOSSY_KV_CACHE_DTYPES],
        action="append",
        default=None,
        help="the engine's KV cache, repeatable: one engine run per value [default: auto, the model's dtype]",
    )
    ap.add_argument("--max-prompt", type=int, default=None, help="[default: 1024 on CUDA, 128 on CPU]")
    ap.add_argument("--min-prompt", type=int, default=None, help="[default: 64/1024 of --max-prompt]")
    ap.add_argument("--mean-prompt", type=float, default=None, help="[default: 300/1024 of --max-prompt]")
    ap.add_argument("--max-reply", type=int, default=None, help="[default: 1024 on CUDA, 64 on CPU]")
    ap.add_argument("--mean-reply", type=float, default=None, help="[default: 500/1024 of --max-reply]")
    ap.add_argument(
        "--batch", type=int, action="append", default=None, help="engine max_batch, repeatable [default: 256]"
    )
    ap.add_argument("--sampled", action="store_true", help="also run the engine with temperature 1, top-p 0.95")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="engine capacity of one request [default: the longest prompt + reply drawn]",
    )
    ap.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto")
    ap.add_argument(
        "--admit-wait-steps",
        type=int,
        action="append",
        default=None,
        help="engine admit_wait_steps, repeatable: one engine run per value [default: the engine's]",
    )
    ap.add_argument(
        "--admit-page-fraction",
        type=float,
        action="append",
        default=None,
        help="engine admit_page_fraction, repeatable: one engine run per value (0: admit whenever a row is free) "
        "[default: the engine's]",
    )
    ap.add_argument(
        "--bucket-step",
        type=int,
        action="append",
        default=None,
        help="engine graph_bucket_step, repeatable: one engine run per value [default: the engine's]",
    )
    ap.add_argument(
        "--warmup-requests", type=int, default=256, help="requests in each warm-up call (8 new tokens each)"
    )
    ap.add_argument(
        "--baseline-batch",
        type=int,
        action="append",
        default=None,
        help="HF generate batch size, repeatable [default: 32 and 256]",
    )
    ap.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="HF runs on the first N requests [default: max(64, its batch)]",
    )
    ap.add_argument("--baseline-max-new-tokens", type=int, default=256, help="HF replies capped at this length")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument(
        "--profile-prefill",
        type=int,
        default=0,
        metavar="N",
        help="also profile one prefill of the first N prompts (operators by device and host time)",
    )
    ap.add_argument(
        "--projection-rows",
        type=int,
        action="append",
        default=[],
        help="also time a decode step's projection matmuls fused vs separate at this many rows (repeatable)",
    )
    ap.add_argument(
        "--profile-decode",
        type=int,
        action="append",
        default=[],
        help="also profile one eager decode step at this many rows (repeatable)",
    )
    ap.add_argument(
        "--overlap-rows",
        type=int,
        action="append",
        default=[],
        help="also time a decode step at this many rows whole against two half-batches on two streams (repeatable)",
    )
    ap.add_argument(
        "--profile-decode-context",
        type=int,
        default=650,
        help="cached tokens per row of --profile-decode and --overlap-rows",
    )
    ap.add_argument("--profile-top", type=int, default=12, help="rows listed by --profile-prefill and --profile-decode")
    ap.add_argument(
        "--compare-rows", type=int, default=64, help="greedy engine vs HF token agreement over the first N requests"
    )
    r = ap.add_argument_group("recipe estimate (regeneration rates measured here; the rest from bench/RESULTS.md)")
    r.add_argument("--recipe-conversations", type=int, default=800_000)
    r.add_argument("--recipe-reply-tokens", type=int, default=1000, help="generated tokens per conversation")
    r.add_argument("--recipe-prompt-tokens", type=int, default=300)
    r.add_argument("--recipe-regen-gpus", type=int, default=5, help="regeneration runs on the extraction GPUs")
    r.add_argument("--recipe-extract-gpus", type=int, default=5)
    r.add_argument("--recipe-train-gpus", type=int, default=3)
    r.add_argument("--recipe-epochs", type=int, default=TRAIN_EPOCHS)
    r.add_argument(
        "--extract-tok-s",
        type=float,
        default=RESULTS_EXTRACT_TOK_S,
        help="extraction tok/s per GPU (RESULTS.md stage one)",
    )
    r.add_argument("--train-step-s", type=float, default=RESULTS_TRAIN_STEP_S, help="RESULTS.md stage two")
    r.add_argument("--train-step-tokens", type=int, default=RESULTS_TRAIN_STEP_TOKENS, help="RESULTS.md stage two")
    args = ap.parse_args(argv)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.shape = args.shape or ("qwen3-8b" if cuda else "tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.requests = args.requests or (2000 if cuda else 64)
    args.max_prompt = args.max_prompt or (1024 if cuda else 128)
    args.max_reply = args.max_reply or (1024 if cuda else 64)
    scale_p = args.max_prompt / 1024
    args.min_prompt = args.min_prompt or max(1, round(64 * scale_p))
    args.mean_prompt = args.mean_prompt or max(args.min_prompt, 300 * scale_p)
    args.mean_reply = args.mean_reply or max(1.0, 500 * args.max_reply / 1024)
    args.batch = args.batch or [256]
    args.bucket_step = args.bucket_step or [EngineSettings.graph_bucket_step]
    args.reuse_prefixes = [v == "on" for v in args.reuse_prefixes or ["on"]]
    args.kv_cache_dtype = [None if v == "auto" else v for v in args.kv_cache_dtype or ["auto"]]
    args.admit_page_fraction = args.admit_page_fraction or [EngineSettings.admit_page_fraction]
    args.admit_wait_steps = args.admit_wait_steps or [EngineSettings.admit_wait_steps]
    if args.turns < 1:
        ap.error("need --turns >= 1")
    if args.chat and not args.target:
        ap.error("--chat needs --target (a real model with its chat template)")
    args.baseline_batch = [] if args.skip_baseline else (args.baseline_batch or [32, 256])
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("need 1 <= --min-prompt <= --max-prompt")
    return args


def main_replay(model, conversations: list[Conversation], args) -> dict:
    """`--replay-pages`: the schedule of every knob setting alone (module doc)."""
    rows = []
    for batch, reuse, pages, wait, bucket, kv_dtype in itertools.product(
        args.batch,
        args.reuse_prefixes,
        args.admit_page_fraction,
        args.admit_wait_steps,
        args.bucket_step,
        args.kv_cache_dtype,
    ):
        knobs = {
            "reuse_prefixes": reuse,
            "admit_page_fraction": pages,
            "admit_wait_steps": wait,
            "graph_bucket_step": bucket,
            "kv_cache_dtype": kv_dtype,
        }
        pool = args.replay_pages * (2 if kv_dtype else 1)  # an fp8 page takes half a bf16 page's bytes
        row = replay_schedule(model, conversations, batch, knobs, pool, args)
        rows.append(row)
        print(
            f"replay B={batch} reuse {'on' if reuse else 'off'} admit pages {pages:g} wait {wait} bucket step {bucket}"
            f"{' fp8 KV' if kv_dtype else ''} on {pool} pages: "
            f"{row['prefills']} prefills of {row['prefill_tokens']:,} tokens ({row['reused_prompt_tokens']:,} cached), "
            f"{row['decode_steps']} decode steps at {row['mean_rows']:.1f} rows, {row['evicted_caches']} caches evicted",
            flush=True,
        )
        if "cost" in row:
            c = row["cost"]
            print(
                f"  modelled on the GPU: decode {c['decode_s']:.1f} s (roofline {c['decode_roofline_s']:.1f}), "
                f"prefill {c['prefill_s']:.1f} s: {c['tok_s']:,.0f} tok/s, {c['of_bound']:.0%} of the bound "
                f"({c['bound_tok_s']:,.0f})",
                flush=True,
            )
    result = {"replay_pages": args.replay_pages, "conversations": len(conversations), "turns": args.turns, "rows": rows}
    emit(result, args.json)
    return result


def main_chat(model, what: str, args, device: torch.device) -> dict:
    """`--chat`: the real-conversation rows alone (module doc); with `--score-replies` each row's
    replies scored by the model in float32 and compared with the first row's (bench/reply_scoring.py)."""
    from bench.reply_scoring import reply_divergence, score_replies
    from dflash_pipeline.shared.target.assets import load_tokenizer

    records = chat_records(args.chat, args.requests)
    result = {"model": what, "device": str(device), "chat": str(args.chat), "records": len(records), "rows": []}
    tokenizer = load_tokenizer(args.target)
    reference = None
    outputs = []
    for batch, reuse, pages, kv_dtype in itertools.product(
        args.batch, args.reuse_prefixes, args.admit_page_fraction, args.kv_cache_dtype
    ):
        knobs = {"reuse_prefixes": reuse, "admit_page_fraction": pages}
        row, messages = run_chat(model, tokenizer, records, batch, knobs, kv_dtype or "auto", args)
        row["identical_to_first_row"] = sum(a == b for a, b in zip(messages, outputs[0])) if outputs else None
        outputs.append(messages)
        free(device)
        same = f"; {row['identical_to_first_row']}/{len(messages)} records as the first row's" if outputs[1:] else ""
        print(
            f"chat B={batch} reuse {'on' if reuse else 'off'} admit pages {pages:g}{' fp8 KV' if kv_dtype else ''}: "
            f"{row['tokens_per_s']:,.0f} generated tok/s ({row['generated_tokens']:,} in {row['seconds']:.1f} s, "
            f"{row['replies']} replies); prompts {row['prefilled_tokens']:,} prefilled + {row['cached_tokens']:,} "
            f"cached{same}",
            flush=True,
        )
        if args.score_replies:
            if reference is None:
                reference = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
            row["scores"] = score_replies(reference, tokenizer, messages, args.chat_max_length)
            if outputs[1:]:
                row["vs_first_row"] = reply_divergence(outputs[0], messages, tokenizer)
            free(device)
            sc, vs = row["scores"], row.get("vs_first_row")
            print(
                f"  {sc['reply_tokens']:,} reply tokens scored in float32: {sc['argmax_agreement']:.2%} the target's "
                f"argmax, mean NLL {sc['mean_nll']:.4f}"
                + (
                    f"; vs the first row: {vs['identical_replies']}/{vs['replies']} replies identical, "
                    f"{vs['common_prefix_fraction']:.1%} of tokens before the first difference"
                    if vs
                    else ""
                ),
                flush=True,
            )
        result["rows"].append(row)
    emit(result, args.json)
    return result


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model, allowed, eos, what = load_model(args, device, dtype)
    if args.chat:
        return main_chat(model, what, args, device)
    if args.replay_pages:
        return main_replay(model, draw_workload(args, allowed), args)
    conversations = draw_workload(args, allowed)
    prompts, lengths = first_turns(conversations)
    all_lengths = [L for c in conversations for _, L in c]
    sizes = model_bytes(model)
    bandwidth = copy_bandwidth(device)
    flops_rate = matmul_rate(device, dtype)
    free(device)
    result = {
        "model": what,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype_name(dtype),
        "args": {k: v for k, v in vars(args).items()},
        "workload": {
            "conversations": len(conversations),
            "turns": args.turns,
            "requests": len(all_lengths),
            "seed": args.seed,
            "prompt_tokens": {
                "min": args.min_prompt,
                "max": args.max_prompt,
                "target_mean": args.mean_prompt,
                "mean": float(np.mean([len(p) for p in prompts])),
                "total": sum(len(p) for p in prompts),
            },
            "user_turn_tokens": {
                "target_mean": args.mean_user_turn,
                "total": sum(len(new) for c in conversations for new, _ in c[1:]),
            },
            "reply_tokens": {
                "min": 1,
                "max": args.max_reply,
                "target_mean": args.mean_reply,
                "mean": float(np.mean(all_lengths)),
                "total": sum(all_lengths),
            },
            "eos_id_hf": eos,
            "stop_ids_engine": [],
        },
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "matmul_TFLOPs": flops_rate / 1e12,
        **sizes,
        "bound_note": "per decode step: weights minus the input embedding table (only gathered) + each row's KV once, "
        "at the copy bandwidth; prefill not charged",
        "engine": [],
        "hf_generate": [],
        "errors": [],
    }
    wl = result["workload"]
    print(
        f"workload: {len(conversations)} conversations x {args.turns} turns, first prompt mean "
        f"{wl['prompt_tokens']['mean']:.1f} ({args.min_prompt}..{args.max_prompt}), reply mean "
        f"{wl['reply_tokens']['mean']:.1f} (1..{args.max_reply}), {sum(all_lengths):,} tokens to generate",
        flush=True,
    )

    def save_partial() -> None:  # a step killed by its timeout still leaves the contenders done so far
        if args.json:
            rows = {
                k: [{f: v for f, v in r.items() if f != "_tokens"} for r in result[k]]
                for k in ("engine", "hf_generate")
            }
            Path(args.json).write_text(json.dumps({**result, **rows, "partial": True}, indent=1))

    def attempt(name: str, fn):
        try:
            return fn()
        except Exception as exc:  # one contender failing (OOM, engine not there) must not lose the others
            traceback.print_exc()
            result["errors"].append(
                {
                    "contender": name,
                    "error": f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                }
            )
            return None
        finally:
            free(device)
            save_partial()

    if args.profile_prefill:
        profiled = attempt(
            "profile prefill", lambda: profile_prefill(model, conversations, args.profile_prefill, args, device)
        )
        if profiled:
            result["prefill_profile"] = profiled
            print(
                f"prefill of {profiled['prompts']} {'continued ' if profiled['continued'] else ''}prompts "
                f"({profiled['prompt_tokens']:,} tokens, {profiled['prefilled_tokens']:,} computed), profiled: "
                f"{profiled['seconds'] * 1e3:.0f} ms ({profiled['seconds_unprofiled'] * 1e3:.0f} ms unprofiled)",
                flush=True,
            )
            for what in ("by_device_time", "by_host_time"):
                print(
                    f"  top ops {what.replace('_', ' ')}: "
                    + "; ".join(
                        f"{r['op']} x{r['calls']} {r['self_device_ms']:.1f}/{r['self_cpu_ms']:.1f} ms"
                        for r in profiled[what]
                    )
                )

    def measure_rows(key: str, name: str, fn, line) -> None:
        """One measurement per --profile-decode / --overlap-rows / --projection-rows size: appended to
        result[key] and printed as `line(row)` when it ran."""
        row = attempt(name, fn)
        if row:
            result.setdefault(key, []).append(row)
            print(line(row), flush=True)

    for rows, kv_dtype in itertools.product(args.profile_decode, args.kv_cache_dtype):
        measure_rows(
            "decode_profile",
            f"profile decode at {rows} rows",
            lambda rows=rows, kv_dtype=kv_dtype: profile_decode(
                model, rows, args.profile_decode_context, args, device, kv_dtype
            ),
            lambda r: (
                f"decode step of {r['rows']} rows at context {r['context']}, {r['kv_cache_dtype']} KV (eager): "
                f"{r['seconds_unprofiled'] * 1e3:.1f} ms, device time {r['device_ms']:.1f} ms; top ops: "
                + "; ".join(f"{o['op'][:40]} x{o['calls']} {o['self_device_ms']:.2f} ms" for o in r["by_device_time"])
            ),
        )
    for rows in args.overlap_rows:
        measure_rows(
            "overlap",
            f"two streams at {rows} rows",
            lambda rows=rows: time_overlap(model, rows, args.profile_decode_context, args, device),
            lambda r: (
                f"decode step of {r['rows']} rows at context {r['context']}: whole {r['whole_ms']:.2f} ms, "
                f"two halves {r['halves_ms']:.2f} ms, two halves on two streams {r['two_streams_ms']:.2f} ms "
                f"({r['streams_gain']:.2f}x the whole step)"
            ),
        )
    for rows in args.projection_rows:
        measure_rows(
            "projections",
            f"projections at {rows} rows",
            lambda rows=rows: time_projections(model, rows, device),
            lambda r: (
                f"q/k/v + gate/up matmuls of {r['layers']} layers at {r['rows']} rows: separate "
                f"{r['separate_ms']:.2f} ms, fused {r['fused_ms']:.2f} ms ({r['speedup']:.2f}x)"
            ),
        )
    for batch, step, reuse, pages, wait, kv_dtype, sampled in itertools.product(
        args.batch,
        args.bucket_step,
        args.reuse_prefixes,
        args.admit_page_fraction,
        args.admit_wait_steps,
        args.kv_cache_dtype,
        [False, True] if args.sampled else [False],
    ):
        knobs = {
            "graph_bucket_step": step,
            "reuse_prefixes": reuse,
            "admit_page_fraction": pages,
            "admit_wait_steps": wait,
            "kv_cache_dtype": kv_dtype,
        }
        name = (
            f"engine batch {batch} bucket step {step} reuse {'on' if reuse else 'off'} "
            f"admit pages {pages:g} wait {wait}{' KV ' + kv_dtype if kv_dtype else ''}{' sampled' if sampled else ''}"
        )
        row = attempt(
            name,
            lambda batch=batch, knobs=knobs, sampled=sampled: run_engine(
                model, conversations, batch, sampled, knobs, args, device
            ),
        )
        if row:
            print(f"{name}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
            result["engine"].append(row)
    for batch in args.baseline_batch if args.turns == 1 else []:
        n = min(len(prompts), args.baseline_requests or max(64, batch))
        row = attempt(
            f"hf_generate batch {batch}",
            lambda batch=batch, n=n: run_hf(
                model, prompts, lengths, batch, n, args.baseline_max_new_tokens, eos, device
            ),
        )
        if row:
            print(f"hf_generate batch {batch}: {row['tokens_per_s']:,.0f} tok/s", flush=True)
            result["hf_generate"].append(row)

    hf = {r["batch"]: r for r in result["hf_generate"]}
    for row in result["engine"]:
        for b, base in hf.items():
            row[f"vs_hf_batch{b}"] = row["tokens_per_s"] / base["tokens_per_s"]
        if "mean_context" in row:
            row_sizes = with_kv_cache_dtype(sizes, row["kv_cache_dtype"], result["dtype"])
            row["bound_tok_s"] = bound_tok_s(row["batch"], row["mean_context"], row_sizes, bandwidth)
            row["fraction_of_bound"] = row["tokens_per_s"] / row["bound_tok_s"]
            st = row["stats"]
            sched_s = (
                st["decode_steps"] * row_sizes["weight_bytes_read_per_step"]
                + st["kv_tokens_read"] * row_sizes["kv_bytes_per_token"]
            ) / bandwidth
            row["schedule_bound_s"] = sched_s
            row["schedule_bound_tok_s"] = row["useful_tokens"] / sched_s
            row["fraction_of_schedule_bound"] = row["tokens_per_s"] / row["schedule_bound_tok_s"]
            roof_s = roofline_s(
                st["decode_steps"],
                st["decode_rows"],
                st["kv_tokens_read"],
                st["prefill_tokens"],
                row_sizes,
                bandwidth,
                flops_rate,
            )
            row["roofline_s"] = roof_s
            row["roofline_tok_s"] = row["useful_tokens"] / roof_s
            row["fraction_of_roofline"] = row["tokens_per_s"] / row["roofline_tok_s"]
        if row["sampling"] == "greedy" and row["batch"] == args.batch[0]:
            for b, base in hf.items():
                row[f"greedy_agreement_hf_batch{b}"] = greedy_agreement(row["_tokens"], base["_tokens"])
    for row in result["engine"] + result["hf_generate"]:
        row.pop("_tokens", None)

    greedy = [r for r in result["engine"] if r["sampling"] == "greedy" and r["kv_cache_dtype"] == result["dtype"]]
    best = max(greedy, key=lambda r: r["tokens_per_s"]) if greedy else None
    old = hf.get(32)
    result["recipe_estimate"] = recipe_estimate(args, best, old and old["tokens_per_s"], sizes, bandwidth)
    emit(result, args.json)
    print_summary(result, args)
    if result["errors"]:
        sys.exit(
            f"bench.regenerate: {len(result['errors'])} contender(s) failed: "
            + "; ".join(f"{e['contender']}: {e['error']}" for e in result["errors"])
        )
    return result


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def print_summary(result: dict, args) -> None:
    """A short table for the tail of the log (gpu_session.sh shows the last 25 lines)."""
    wl = result["workload"]
    print(
        f"\n== regenerate: {result['model']} on {result['device']}; {wl['conversations']} conversations x "
        f"{wl['turns']} turns, first prompts mean "
        f"{wl['prompt_tokens']['mean']:.0f} ({args.min_prompt}..{args.max_prompt}), replies mean "
        f"{wl['reply_tokens']['mean']:.0f} (1..{args.max_reply}), each ending at its drawn length"
    )
    print(
        f"copy bandwidth {result['copy_bandwidth_GBps']:,.0f} GB/s; matmul {result['matmul_TFLOPs']:,.0f} TFLOP/s; "
        f"weights {human_bytes(result['weight_bytes'])} "
        f"({human_bytes(result['weight_bytes_read_per_step'])} read per step: embedding table excluded); "
        f"KV {human_bytes(result['kv_bytes_per_token'])}/token"
    )
    hf_batches = [r["batch"] for r in result["hf_generate"]]
    print(
        f"{'contender':<46}{'reqs':>5}{'tokens':>10}{'tok/s':>8}"
        + "".join(f"{'/HF' + str(b):>8}" for b in hf_batches)
        + f"{'ctx':>6}{'rows':>6}{'bound':>9}{'frac':>5}{'sched':>9}{'frac':>5}{'roof':>9}{'frac':>5}"
    )
    for r in result["engine"]:
        name = f"engine {r['sampling']} B={r['batch']} s={r['bucket_step']} p={r['admit_page_fraction']:.3g}"
        name += f" w={r['admit_wait_steps']}"
        name += "" if r["reuse_prefixes"] else " noreuse"
        name += "" if r["kv_cache_dtype"] == result["dtype"] else " fp8 KV"
        line = f"{name:<46}{r['requests']:>5}{r['useful_tokens']:>10,}{r['tokens_per_s']:>8,.0f}"
        line += "".join(f"{r.get(f'vs_hf_batch{b}', float('nan')):>7.2f}x" for b in hf_batches)
        if "bound_tok_s" in r:
            line += (
                f"{r['mean_context']:>6.0f}{r.get('mean_active_rows', float('nan')):>6.0f}{r['bound_tok_s']:>9,.0f}"
                f"{r['fraction_of_bound']:>5.0%}{r['schedule_bound_tok_s']:>9,.0f}{r['fraction_of_schedule_bound']:>5.0%}"
                f"{r['roofline_tok_s']:>9,.0f}{r['fraction_of_roofline']:>5.0%}"
            )
        print(line)
    for r in result["hf_generate"]:
        name = f"HF generate B={r['batch']} cap {r['max_new_tokens_cap']}"
        print(f"{name:<46}{r['requests']:>5}{r['useful_tokens']:>10,}{r['tokens_per_s']:>8,.0f}")
    print(
        "ctx: mean context per decode row; rows: mean active rows per step; bound: B rows at ctx; "
        "sched: the engine's own steps (prefill uncharged); roof: its steps and prefill with matmuls at the matmul rate"
    )
    for r in result["engine"]:
        notes = [
            f"graphs {r['graph_capture_s']:.1f} s" if r.get("graph_capture_s") else "",
            f"prefill {r['stats'].get('prefill_seconds', 0):.1f} s ({r['stats'].get('prefill_tokens', 0):,} tokens, "
            f"{r['stats'].get('reused_prompt_tokens', 0):,} reused, {r['stats'].get('prefills', 0)} prefills), "
            f"decode {r['stats'].get('decode_seconds', 0):.1f} s",
            f"{r['length_mismatches']} replies NOT at their drawn length" if r["length_mismatches"] else "",
        ]
        for k, v in r.items():
            if k.startswith("greedy_agreement") and v["common_prefix_fraction"] is not None:
                notes.append(
                    f"vs {k.removeprefix('greedy_agreement_')}: {v['identical_rows']}/{v['rows']} identical, "
                    f"prefix {v['common_prefix_fraction']:.0%}"
                )
        print(f"engine {r['sampling']} B={r['batch']}: " + "; ".join(n for n in notes if n))
    for e in result["errors"]:
        print(f"!! {e['contender']}: {e['error']}")
    est = result["recipe_estimate"]
    print(
        f"recipe: {est['conversations']:,} conversations, {est['prompt_tokens']} prompt + {est['reply_tokens']} reply tokens; "
        f"regen on {est['regen_gpus']} GPUs, extraction {est['extract_gpus']}, training {est['train_gpus']} ({est['epochs']} epochs)"
    )
    for name, how in (
        ("engine", f"the engine's (B={est.get('engine_batch')}), measured here"),
        ("engine_at_recipe_context", "the engine's moved to the recipe's context by the bound, modelled"),
        (
            "old_hf_batch32",
            f"HF batch 32's (old default), measured here, replies capped at {args.baseline_max_new_tokens}",
        ),
    ):
        if f"regen_{name}_h" in est:
            print(
                f"  regeneration {est[f'regen_{name}_h']:6.1f} h at {est[f'regen_{name}_tok_s_per_gpu']:>7,.0f} tok/s/GPU: {how}"
                f" (end to end {est[f'total_{name}_h']:.1f} h)"
            )
    print(
        f"  extraction {est['extract_h']:.1f} h at {args.extract_tok_s:,.0f} tok/s/GPU; training {est['train_h']:.1f} h at "
        f"{args.train_step_s} s per {args.train_step_tokens}-token step (both from bench/RESULTS.md); stages in sequence"
    )


if __name__ == "__main__":
    main()
