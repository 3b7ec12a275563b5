"""Continuous-batching generation of many replies with one target model in one process.

Requests wait in a queue; whenever enough decode rows are free, waiting prompts are admitted and
prefilled together (packed, no padding), their keys and values written into cache pages reserved
for prompt + reply. Every step then decodes one token for every running request. A request leaves
as soon as it emits a stop id or reaches its own `max_new_tokens`, and its row and pages go to
the next prompt: the batch stays full instead of waiting for its longest reply.

On CUDA the decode step is captured once per batch bucket as a CUDA graph (rows padded to the
bucket point at a scratch slot), so a step costs one graph launch rather than ~30 kernel launches
per layer from Python. Every row's token is a function of its own request (see `sampling`): the
replies do not depend on which requests ran together.

Turns of one conversation: a request marked `keep_cache` leaves its keys and values in the cache
when it finishes, and the next request added under the same id (the conversation's next turn, whose
prompt repeats the earlier prompt and reply) computes only what follows their longest common prefix.
Without it, every turn prefills its whole conversation again: on chat data more prompt tokens than
the replies generate. Kept caches wait at most until pages run short (then the oldest go first) or
`release`; a request that reuses one jumps the queue, so its pages are not held idle for long.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_pipeline.shared.generation.decoder import (
    GenerationError,
    PagedDecoder,
    PagedKVCache,
    check_supported,
    pages_for,
)
from dflash_pipeline.shared.generation.paged_attention import KV_FP8
from dflash_pipeline.shared.generation.sampling import SamplingParams, choose_tokens
from dflash_pipeline.shared.target.loading import text_config

WORKSPACE_MARGIN_BYTES = 2 << 30  # beside the estimate: CUDA graphs' pool, library workspaces
# A prefill of continued prompts gathers every prompt's cached keys/values (GQA: repeated per query
# head for the varlen kernel) per layer: their whole contexts may be at most this many times
# `prefill_tokens`, so that copy stays within the workspace's margin.
CONTEXT_PER_PREFILL = 4
KV_CACHE_DTYPES = {None: None, "float8_e4m3fn": KV_FP8}  # EngineSettings.kv_cache_dtype -> the cache's dtype
LOSSY_KV_CACHE_DTYPES = tuple(name for name in KV_CACHE_DTYPES if name)  # what a CLI offers beside the default


@dataclass(frozen=True)
class EngineSettings:
    max_batch: int = 256  # requests decoded together at most
    max_request_tokens: int = 4096  # prompt + reply of one request, at most
    page_size: int = 64  # tokens per KV-cache page
    prefill_tokens: int = 16384  # prompt tokens packed into one prefill forward (one longer prompt runs alone)
    cuda_graphs: bool | None = None  # None: on for CUDA
    compile: bool | None = None  # compile the layers' pointwise work; None: on for CUDA
    num_pages: int | None = None  # KV-cache pages; None: what fits (CUDA) or max_batch full requests (CPU)
    admit_fraction: float = 1 / 32  # prefill once this share of the rows is free (fewer, larger prefills)
    # ... and this share of the KV-cache pages (free or kept): when pages, not rows, bound the batch
    # (long contexts), each finished reply would otherwise let one or two prompts in, one prefill each
    admit_page_fraction: float = 1 / 32
    # ... and once that many prompts wait, or the oldest has waited this many decode steps: with rows
    # to spare (fewer conversations than rows, the tail of a run), each finished turn's next turn would
    # otherwise get a prefill call of its own, and a call costs tens of ms whatever its size
    admit_wait_steps: int = 8
    graph_bucket_step: int = 64  # CUDA graphs for every multiple of this many rows (see graph_buckets)
    reuse_prefixes: bool = True  # honour Request.keep_cache (off: every request prefills its whole prompt)
    # None: the model's dtype (lossless). "float8_e4m3fn": half the bytes a decode step reads and holds
    # per token, so faster steps and twice the tokens in the cache, at the cost of replies that are no
    # longer the model's own computation (keys and values rounded to 3 mantissa bits)
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if min(self.max_batch, self.page_size, self.prefill_tokens, self.graph_bucket_step) < 1:
            raise ValueError("EngineSettings: max_batch, page_size, prefill_tokens, graph_bucket_step must be >= 1")
        if self.admit_wait_steps < 0:
            raise ValueError("EngineSettings: admit_wait_steps must be >= 0")
        if self.max_request_tokens < 2:
            raise ValueError("EngineSettings: max_request_tokens must be >= 2")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineSettings: kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(LOSSY_KV_CACHE_DTYPES)} "
                "or None (the model's dtype)"
            )


@dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int
    key: int = 0  # the request's sampling key (sampling.request_key); unused when greedy
    keep_cache: bool = False  # keep the keys/values for the next request of this id (module doc)


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)  # generated ids, the stop id included if one ended it
    finished: bool = False  # ended by a stop id (False: cut at max_new_tokens)


@dataclass
class _Running:
    request_id: Hashable
    request: Request
    slot: int
    pages: list[int]
    cached: int = 0  # prompt tokens whose keys/values an earlier request of this id left in `pages`
    reply: Reply = field(default_factory=Reply)


@dataclass
class _Kept:
    """A finished request's cache, kept for the next request of its id: the tokens whose keys and
    values `pages` hold (the prompt and all of the reply but its last token, never fed back)."""

    tokens: list[int]
    pages: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def graph_buckets(max_batch: int, step: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two up to `step`, then every multiple of
    `step`, and max_batch. Rows are padded up to the next size and the padding rows' matmuls are
    real work: at hundreds of rows the step is compute-bound, so 379 rows padded to 512 would cost a
    third more than to 384."""
    sizes = {max_batch}
    size = 1
    while size < min(step, max_batch):
        sizes.add(size)
        size *= 2
    sizes.update(range(step, max_batch, step))
    return sorted(sizes)


class GenerationEngine:
    """See the module doc. Single-threaded by design: `step()` is called from one thread."""

    def __init__(
        self,
        model: nn.Module,
        *,
        stop_ids: Iterable[int],
        sampling: SamplingParams,
        settings: EngineSettings = EngineSettings(),
    ):
        check_supported(model, settings.max_request_tokens)
        self.settings = settings
        self.sampling = sampling
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        cache_dtype = KV_CACHE_DTYPES[settings.kv_cache_dtype] or dtype
        config = text_config(model.config)
        attn = model.model.layers[0].self_attn
        layers, kv_heads, head_dim = len(model.model.layers), config.num_key_value_heads, attn.head_dim
        self.pages_per_request = pages_for(settings.max_request_tokens, settings.page_size)
        pages = settings.num_pages or self._pages_that_fit(config, layers, kv_heads, head_dim, dtype, cache_dtype)
        if pages < self.pages_per_request + 1:
            raise GenerationError(
                f"the KV cache holds {pages - 1} pages of {settings.page_size} tokens, fewer than one "
                f"request of {settings.max_request_tokens} tokens needs; lower --max-length or "
                "--max-new-tokens, or free device memory"
            )
        cache = PagedKVCache.allocate(layers, pages, settings.page_size, kv_heads, head_dim, cache_dtype, self.device)
        compiled = settings.compile if settings.compile is not None else self.device.type == "cuda"
        self.decoder = PagedDecoder(model, cache, compile=compiled)
        self._free_pages = list(range(pages - 1, 0, -1))  # page 0 is scratch
        slots = settings.max_batch
        self._free_slots = list(range(slots - 1, -1, -1))
        self.scratch_slot = slots
        on_device = {"device": self.device, "dtype": torch.long}
        self.slot_token = torch.zeros(slots + 1, **on_device)
        self.slot_position = torch.zeros(slots + 1, **on_device)
        self.slot_prompt_length = torch.zeros(slots + 1, **on_device)
        self.slot_key = torch.zeros(slots + 1, **on_device)
        self.block_table = torch.zeros(slots + 1, self.pages_per_request, dtype=torch.int32, device=self.device)
        self._queue: deque[tuple[Hashable, Request]] = deque()
        self._running: dict[int, _Running] = {}
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()  # oldest first
        self._kept_pages = 0
        self._pages_to_admit = int((pages - 1) * settings.admit_page_fraction)
        self._steps_waited = 0  # decode steps since the queue last had a prompt admitted
        self._context_tokens = 0  # cached tokens of the running requests: what the next decode step reads
        use_graphs = settings.cuda_graphs if settings.cuda_graphs is not None else self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise GenerationError("cuda_graphs needs a CUDA device")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._rows_in_graph: dict[int, list[int]] = {}
        self.stats = {
            "decode_steps": 0,
            "decode_rows": 0,
            "kv_tokens_read": 0,
            "prefill_tokens": 0,
            "reused_prompt_tokens": 0,
            "evicted_caches": 0,
            "prefills": 0,
            "generated_tokens": 0,
            "requests": 0,
            "prefill_seconds": 0.0,
            "decode_seconds": 0.0,
            "warmup_seconds": 0.0,
            "kv_cache_pages": pages,
            "page_size": settings.page_size,
            "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
        }
        if use_graphs:
            self._capture_graphs()

    def _workspace_bytes(self, config, dtype: torch.dtype) -> int:
        """Device memory to leave beside the cache: twice the estimated peak of one prefill (hidden-
        size and MLP-size activations of `prefill_tokens`) plus the decode logits and sampling buffers,
        so the allocator never has to free and retry mid-prefill, which slows prefill severalfold."""
        prefill = (
            self.settings.prefill_tokens * (10 * config.hidden_size + 6 * config.intermediate_size) * dtype.itemsize
        )
        logits = self.settings.max_batch * config.vocab_size * 16  # float32 logits, sorted copy, cumsum
        return 2 * (prefill + logits) + WORKSPACE_MARGIN_BYTES

    def _pages_that_fit(
        self, config, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype
    ) -> int:
        per_page = PagedKVCache.bytes_per_token(layers, kv_heads, head_dim, cache_dtype) * self.settings.page_size
        if self.device.type != "cuda":
            return self.settings.max_batch * self.pages_per_request + 1
        torch.cuda.empty_cache()  # what the allocator caches counts as used in mem_get_info
        free, _ = torch.cuda.mem_get_info(self.device)
        usable = free - self._workspace_bytes(config, dtype)
        # no more than every row at full length could use
        return max(1, min(usable // per_page, self.settings.max_batch * self.pages_per_request + 1))

    # ---------------------------------------------------------------- requests in, replies out

    def add(self, request_id: Hashable, request: Request) -> None:
        """Queue a request; `step()` returns its reply under `request_id` when it is done."""
        need = len(request.prompt) + request.max_new_tokens
        if not request.prompt or request.max_new_tokens < 1:
            raise GenerationError(f"request {request_id!r}: empty prompt or max_new_tokens < 1")
        if need > self.settings.max_request_tokens:
            raise GenerationError(
                f"request {request_id!r}: prompt {len(request.prompt)} + {request.max_new_tokens} new "
                f"tokens exceed the engine's {self.settings.max_request_tokens} tokens per request"
            )
        if request_id in self._kept:
            self._queue.appendleft((request_id, request))
        else:
            self._queue.append((request_id, request))

    def release(self, request_id: Hashable) -> None:
        """Free the cache a `keep_cache` request left under `request_id`, if any (no next turn)."""
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            self._free_pages.extend(kept.pages)
            self._kept_pages -= len(kept.pages)

    @property
    def running(self) -> int:
        """Requests being decoded now."""
        return len(self._running)

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return len(self._queue) + len(self._running)

    def generate(self, requests: Sequence[Request]) -> list[Reply]:
        """Replies to `requests`, in order."""
        for i, request in enumerate(requests):
            self.add(i, request)
        replies: list[Reply | None] = [None] * len(requests)
        while self.pending:
            for i, reply in self.step():
                replies[i] = reply
        return replies  # type: ignore[return-value]

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Reply]]:
        """Admit and prefill waiting prompts if enough rows are free, then decode one token for
        every running request; returns the requests that finished in this step."""
        finished: list[tuple[Hashable, Reply]] = []
        free_needed = max(1, int(self.settings.max_batch * self.settings.admit_fraction))
        room = len(self._free_slots) >= free_needed and (
            len(self._free_pages) + self._kept_pages >= self._pages_to_admit
        )
        enough = len(self._queue) >= free_needed or self._steps_waited >= self.settings.admit_wait_steps
        if self._queue and ((room and enough) or len(self._running) < free_needed):
            finished += self._admit()
            self._steps_waited = 0
        elif self._queue:
            self._steps_waited += 1
        if self._running:
            finished += self._decode()
        return finished

    # ---------------------------------------------------------------- prefill

    def _admit(self) -> list[tuple[Hashable, Reply]]:
        finished = []
        while self._queue and self._free_slots:
            batch: list[_Running] = []
            tokens = context = 0
            while self._queue and self._free_slots:
                request_id, request = self._queue[0]
                kept = self._kept.get(request_id)
                cached = 0 if kept is None else min(common_prefix(kept.tokens, request.prompt), len(request.prompt) - 1)
                pages = pages_for(len(request.prompt) + request.max_new_tokens, self.settings.page_size)
                too_long = batch and (
                    tokens + len(request.prompt) - cached > self.settings.prefill_tokens
                    or context + len(request.prompt) > CONTEXT_PER_PREFILL * self.settings.prefill_tokens
                )
                if too_long or not self._make_room(pages - (0 if kept is None else len(kept.pages)), request_id):
                    break
                self._queue.popleft()
                batch.append(self._start(request_id, request, pages, cached))
                tokens += len(request.prompt) - cached
                context += len(request.prompt)
            if not batch:
                if not self._running:  # nothing will ever free pages: the pool is too small
                    raise GenerationError(f"request {self._queue[0][0]!r} needs more KV-cache pages than exist")
                break
            finished += self._prefill(batch)
        return finished

    def _make_room(self, pages: int, request_id: Hashable) -> bool:
        """Whether `pages` pages are free, after freeing kept caches (oldest first, never the one
        `request_id` is about to reuse) if needed."""
        while pages > len(self._free_pages):
            victim = next((r for r in self._kept if r != request_id), None)
            if victim is None:
                return False
            self.release(victim)
            self.stats["evicted_caches"] += 1
        return True

    def _start(self, request_id: Hashable, request: Request, pages: int, cached: int) -> _Running:
        """A row for the request: its kept pages first (all of them or as many as it needs), then new ones."""
        kept = self._kept.pop(request_id, None)
        own = [] if kept is None else kept.pages
        self._kept_pages -= len(own)
        self._free_pages.extend(own[pages:])
        own = own[:pages]
        own += [self._free_pages.pop() for _ in range(pages - len(own))]
        return _Running(request_id, request, self._free_slots.pop(), own, cached=cached)

    def _prefill(self, batch: list[_Running]) -> list[tuple[Hashable, Reply]]:
        start = time.perf_counter()
        page = self.settings.page_size
        ids, positions, cache_index, context_index = [], [], [], []
        continued = any(run.cached for run in batch)
        for run in batch:
            n, cached = len(run.request.prompt), run.cached
            ids.extend(run.request.prompt[cached:])
            positions.extend(range(cached, n))
            slots = [run.pages[t // page] * page + t % page for t in range(n)]
            cache_index.extend(slots[cached:])
            if continued:
                context_index.extend(slots)
            table = torch.zeros(self.pages_per_request, dtype=torch.int32)
            table[: len(run.pages)] = torch.tensor(run.pages, dtype=torch.int32)
            self.block_table[run.slot].copy_(table)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device)

        prompts = [len(r.request.prompt) for r in batch]
        logits = self.decoder.prefill(
            as_tensor(ids),
            as_tensor(positions),
            as_tensor(cache_index),
            [n - r.cached for n, r in zip(prompts, batch)],
            as_tensor(context_index) if continued else None,
            prompts if continued else None,
        )
        slots = as_tensor([r.slot for r in batch])
        keys = as_tensor([r.request.key for r in batch])
        first = choose_tokens(logits, keys, torch.zeros_like(keys), self.sampling)
        lengths = as_tensor(prompts)
        self.slot_token[slots] = first
        self.slot_position[slots] = lengths
        self.slot_prompt_length[slots] = lengths
        self.slot_key[slots] = keys
        tokens = first.tolist()
        self.stats["prefill_tokens"] += len(ids)
        self.stats["reused_prompt_tokens"] += sum(prompts) - len(ids)
        self.stats["prefills"] += 1
        self.stats["requests"] += len(batch)
        for run in batch:
            self._running[run.slot] = run
        self._context_tokens += sum(prompts)
        done = self._take_tokens([r.slot for r in batch], tokens)
        self.stats["prefill_seconds"] += time.perf_counter() - start
        return done

    # ---------------------------------------------------------------- decode

    def _decode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The decode step over slot ids `rows` (capturable): next token of each row, slot state advanced."""
        positions = self.slot_position[rows]
        logits = self.decoder.decode(self.slot_token[rows], positions, self.block_table[rows])
        steps = positions - self.slot_prompt_length[rows] + 1  # index of the new token in the reply
        nxt = choose_tokens(logits, self.slot_key[rows], steps, self.sampling)
        self.slot_token[rows] = nxt
        self.slot_position[rows] = positions + 1
        self.slot_position[self.scratch_slot :].zero_()  # padding rows never move the scratch slot
        return nxt

    def _decode(self) -> list[tuple[Hashable, Reply]]:
        start = time.perf_counter()
        slots = sorted(self._running)
        if self._graphs:
            size = next(b for b in sorted(self._graphs) if b >= len(slots))
            graph, rows, out = self._graphs[size]
            padded = slots + [self.scratch_slot] * (size - len(slots))
            if self._rows_in_graph.get(size) != padded:
                rows.copy_(torch.tensor(padded, dtype=torch.long))
                self._rows_in_graph[size] = padded
            graph.replay()
            tokens = out[: len(slots)].tolist()
        else:
            tokens = self._decode_rows(torch.tensor(slots, dtype=torch.long, device=self.device)).tolist()
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(slots)
        self.stats["kv_tokens_read"] += self._context_tokens
        done = self._take_tokens(slots, tokens)
        self.stats["decode_seconds"] += time.perf_counter() - start
        return done

    def _capture_graphs(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            buckets = graph_buckets(self.settings.max_batch, self.settings.graph_bucket_step)
            for size in sorted(buckets, reverse=True):  # largest first: the pool fits all
                rows = torch.full((size,), self.scratch_slot, dtype=torch.long, device=self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up outside capture: lazy kernel loads and library handles
                        self._decode_rows(rows)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._decode_rows(rows)
                self._graphs[size] = (graph, rows, out)
        torch.cuda.synchronize(self.device)
        self.stats["warmup_seconds"] += time.perf_counter() - start

    # ---------------------------------------------------------------- bookkeeping

    def _take_tokens(self, slots: list[int], tokens: list[int]) -> list[tuple[Hashable, Reply]]:
        done = []
        self._context_tokens += len(tokens)
        for slot, token in zip(slots, tokens):
            run = self._running[slot]
            run.reply.tokens.append(token)
            if token in self.stop_ids:
                run.reply.finished = True
            if run.reply.finished or len(run.reply.tokens) >= run.request.max_new_tokens:
                del self._running[slot]
                self._context_tokens -= len(run.request.prompt) + len(run.reply.tokens)
                self._free_slots.append(slot)
                self._finish_pages(run)
                done.append((run.request_id, run.reply))
        self.stats["generated_tokens"] += len(tokens)
        return done

    def _finish_pages(self, run: _Running) -> None:
        """Free a finished request's pages, or keep those holding its tokens for the next request of its id."""
        if not (run.request.keep_cache and self.settings.reuse_prefixes):
            self._free_pages.extend(run.pages)
            return
        tokens = [*run.request.prompt, *run.reply.tokens[:-1]]  # the last token's keys were never computed
        used = pages_for(len(tokens), self.settings.page_size)
        self._free_pages.extend(run.pages[used:])
        self.release(run.request_id)  # a cache that an earlier request of this id left and none took
        self._kept[run.request_id] = _Kept(tokens, run.pages[:used])
        self._kept_pages += used
