"""`dflash-extract --regenerate`: replace the assistant replies by the target's own before extraction.

A drafter learns to predict what the target writes, so it trains best on the target's own replies
rather than the dataset's (written by another model or a person). Each rank regenerates the
conversations it owns with one continuous-batching engine (`dflash_pipeline.shared.generation`): every
conversation is a chain of requests, turn by turn (reply k is asked for once reply k-1 is in its
history), and all chains share the engine's batch, so a long conversation never holds up others.

With `samples_per_prompt` N > 1 every conversation yields N samples (sample indices `index*N + s`),
all starting with the same prompt, so the held-out split's prompt groups keep them together.

Reproducible by construction: a sampled reply depends only on (seed, conversation index, turn,
sample) through its request key, not on batch composition, batch size or worker count.

Crash safety: each finished conversation is appended to ``ROOT/regenerated/rank-XXXXX.jsonl`` at once
and fsynced within `FSYNC_INTERVAL_S` (a torn last line is ignored), so a rerun reuses them and
generates only the rest.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from dflash_pipeline.data.chat import UNFINISHED, generation_prompt_ids, stop_token_ids
from dflash_pipeline.data.records import Record
from dflash_pipeline.shared.generation.engine import (
    LOSSY_KV_CACHE_DTYPES,
    EngineSettings,
    GenerationEngine,
    Request,
)
from dflash_pipeline.shared.generation.sampling import SamplingParams, request_key
from dflash_pipeline.shared.runtime.config import ConfigError, check_options, option
from dflash_pipeline.shared.runtime.progress import progress_bar, progress_note

FSYNC_INTERVAL_S = 2.0


@dataclass(frozen=True)
class RegenerateSettings:
    """What decides the replies; recorded in the manifest and the data fingerprint. How fast they are
    made (the engine's batch size) is not among them: it does not change a reply."""

    max_new_tokens: int = option(512, range=(1, None), help="--regenerate: reply length limit.")
    temperature: float = option(0.0, range=(0, None), help="--regenerate: 0 = greedy, else sampled.")
    top_p: float = option(1.0, range=(0, 1), min_open=True, help="--regenerate: nucleus sampling.")
    top_k: int = option(0, range=(0, None), help="--regenerate: sample among the k likeliest tokens (0: all).")
    seed: int = option(0, help="--regenerate: sampling seed.")
    samples_per_prompt: int = option(
        1,
        range=(1, None),
        help="--regenerate: replies per conversation, each stored as its own sample (needs --temperature > 0).",
    )
    kv_cache_dtype: str = option(
        "auto",
        choices=("auto", *LOSSY_KV_CACHE_DTYPES),
        help="--regenerate: the generation engine's KV cache. float8_e4m3fn halves the bytes a decode step reads "
        "(faster on GPU, twice the tokens in memory) but rounds keys and values, so replies are no longer "
        "exactly the target's own [default: auto, the target's dtype: lossless].",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ConfigError(
                "regenerate: --samples-per-prompt > 1 needs --temperature > 0 "
                "(greedy replies to one prompt are all the same)"
            )

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)

    def to_dict(self) -> dict:
        values = asdict(self)
        # the lossless default is left out: stores made before the option keep their fingerprint
        if values["kv_cache_dtype"] == "auto":
            del values["kv_cache_dtype"]
        return {"method": "greedy" if self.temperature == 0 else "sampled", **values}

    @property
    def engine_kv_cache_dtype(self) -> str | None:
        return None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @classmethod
    def from_dict(cls, values: dict) -> RegenerateSettings:
        return cls(**{k: v for k, v in values.items() if k != "method"})


@dataclass
class RegenerateStats:
    """Counts of one rank's regeneration (deterministic: they go into the manifest)."""

    conversations: int = 0  # samples with at least one regenerated reply
    replies: int = 0
    generated_tokens: int = 0
    unfinished: int = 0  # replies stopped by max_new_tokens, not by an end-of-turn token
    cut: int = 0  # conversations cut before a turn whose prompt no longer fits max_length
    kept: int = 0  # records left as they were (plain text, or no reply prompt fits)
    reused: int = 0  # conversations taken from an earlier, interrupted run

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationTiming:
    """What this invocation generated and how long it took (not in the manifest: it varies by run)."""

    tokens: int = 0
    seconds: float = 0.0
    prefilled_tokens: int = 0  # prompt tokens run through the target
    cached_tokens: int = 0  # prompt tokens whose keys/values the conversation's earlier turn left


def read_cache(path: Path) -> dict[int, dict]:
    """Committed lines of an earlier run: sample index -> entry. A torn last line (crash mid-write) is dropped."""
    entries: dict[int, dict] = {}
    if not path.exists():
        return entries
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            entry = json.loads(line)
            entries[entry["index"]] = entry
    return entries


def truncate_torn_tail(path: Path) -> None:
    """Cut a partial last line so new appends start on a line boundary."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)


def sample_index(record_index: int, sample: int, samples_per_prompt: int) -> int:
    """The store's sample index of reply sample `sample` of input record `record_index`."""
    return record_index * samples_per_prompt + sample


@dataclass
class _Conversation:
    """One sample being rebuilt: the original turns and the new ones so far."""

    record: Record
    input_index: int  # the record's index in the input (the conversation part of its sampling keys)
    sample: int
    index: int  # the sample's index in the store
    new: list[dict] = field(default_factory=list)
    next_turn: int = 0
    reply_tokens: list[int] = field(default_factory=list)
    unfinished: int = 0
    cut: bool = False

    def has_later_reply(self) -> bool:
        """Whether a turn after the reply being asked for is another reply to regenerate."""
        return any(m["role"] == "assistant" for m in self.record.messages[self.next_turn + 1 :])

    def advance_to_reply(self) -> bool:
        """Copy turns up to the next assistant turn that answers a prompt; False at the end."""
        messages = self.record.messages
        while self.next_turn < len(messages):
            m = messages[self.next_turn]
            if m["role"] == "assistant" and self.next_turn > 0:
                return True
            self.new.append(dict(m))
            self.next_turn += 1
        return False

    def entry(self) -> dict:
        if not self.reply_tokens:
            return {"index": self.index, "messages": None}
        messages = self.new
        if self.cut:  # end on the last regenerated reply, not on a prompt that was never answered
            while messages[-1]["role"] != "assistant":
                messages = messages[:-1]
        return {
            "index": self.index,
            "messages": messages,
            "reply_tokens": self.reply_tokens,
            "unfinished": self.unfinished,
            "cut": self.cut,
        }


class _CacheSink:
    """Appends finished entries to the rank's cache file. Each line goes to the OS at once (a killed
    process loses nothing written); fsync, for a crash of the machine, at most every FSYNC_INTERVAL_S
    and at the end."""

    def __init__(self, file: IO[str]):
        self.file = file
        self.synced = time.monotonic()

    def write(self, entry: dict) -> None:
        self.file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.file.flush()
        if time.monotonic() - self.synced >= FSYNC_INTERVAL_S:
            self.sync()

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.synced = time.monotonic()


class _Regenerator:
    """Feeds every conversation's turns through one engine, writing each conversation when its last reply is in."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        settings: RegenerateSettings,
        max_length: int,
        template_kwargs: dict | None,
        sink: _CacheSink,
    ):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.max_length, self.template_kwargs, self.sink = max_length, template_kwargs, sink
        self.convs: dict[int, _Conversation] = {}
        self.done: dict[int, dict] = {}

    def start(self, conv: _Conversation) -> None:
        self.convs[conv.index] = conv
        self._ask_or_finish(conv)

    def _ask_or_finish(self, conv: _Conversation) -> None:
        if conv.advance_to_reply():
            prompt = generation_prompt_ids(
                self.tokenizer, conv.new, template_kwargs=self.template_kwargs, source=conv.record.source
            )
            if len(prompt) < self.max_length:
                turn = len(conv.reply_tokens)
                key = request_key(self.settings.seed, conv.input_index, turn, conv.sample)
                # a later turn's prompt starts with this one and its reply: keep their keys and values
                keep = conv.has_later_reply()
                self.engine.add(conv.index, Request(prompt, self.settings.max_new_tokens, key, keep_cache=keep))
                return
            conv.cut = True
        self.engine.release(conv.index)
        entry = conv.entry()
        del self.convs[conv.index]
        self.done[conv.index] = entry
        self.sink.write(entry)

    def accept(self, index: int, tokens: list[int], finished: bool) -> None:
        conv = self.convs[index]
        body = tokens[:-1] if finished else tokens
        message = {"role": "assistant", "content": self.tokenizer.decode(body, skip_special_tokens=True)}
        if not finished:  # cut at max_new_tokens: the template's end-of-turn after it is no label
            message[UNFINISHED] = True
        conv.new.append(message)
        conv.next_turn += 1
        conv.reply_tokens.append(len(tokens))
        conv.unfinished += int(not finished)
        self._ask_or_finish(conv)


def regenerate_records(
    records: list[tuple[int, Record]],
    load_model: Callable[[], Any],
    tokenizer: Any,
    settings: RegenerateSettings,
    *,
    max_length: int,
    cache: Path,
    rank: int = 0,
    engine: EngineSettings | None = None,
    template_kwargs: dict | None = None,
) -> tuple[list[tuple[int, Record]], RegenerateStats, GenerationTiming]:
    """(sample index, record) for every sample of the (input index, record) pairs `records`
    (`samples_per_prompt` per conversation), the assistant replies generated by the target (see
    module doc). `load_model` is called only if some conversation is not in the cache yet (a
    finished rank reruns free)."""
    n = settings.samples_per_prompt
    stats = RegenerateStats()
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = read_cache(cache)
    truncate_torn_tail(cache)
    samples = [(i, r, s, sample_index(i, s, n)) for i, r in records if r.messages is not None for s in range(n)]
    todo = [_Conversation(r, i, s, index) for i, r, s, index in samples if index not in done]
    stats.reused = len(samples) - len(todo)
    timing = GenerationTiming()
    if todo:
        done.update(
            _generate(todo, load_model(), tokenizer, settings, max_length, cache, rank, engine, template_kwargs, timing)
        )
    out: list[tuple[int, Record]] = []
    for i, record in records:
        if record.messages is None:
            out.append((sample_index(i, 0, n), record))
            stats.kept += 1
            continue
        for s in range(n):
            index = sample_index(i, s, n)
            entry = done[index]
            out.append(
                (
                    index,
                    record
                    if entry["messages"] is None
                    else Record(record.index, f"{record.source} (regenerated)", messages=entry["messages"]),
                )
            )
            _count(stats, entry)
    return out, stats, timing


def _generate(
    todo: list[_Conversation],
    model: Any,
    tokenizer: Any,
    settings: RegenerateSettings,
    max_length: int,
    cache: Path,
    rank: int,
    engine_settings: EngineSettings | None,
    template_kwargs: dict | None,
    timing: GenerationTiming,
) -> dict[int, dict]:
    stops = stop_token_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))
    if not stops:
        raise ValueError("regenerate: the tokenizer has no EOS or end-of-turn token; replies would never stop")
    base = engine_settings or EngineSettings()
    capacity = max_length + settings.max_new_tokens
    built = time.perf_counter()
    engine = GenerationEngine(
        model,
        stop_ids=stops,
        sampling=settings.sampling,
        settings=EngineSettings(
            **{**asdict(base), "max_request_tokens": capacity, "kv_cache_dtype": settings.engine_kv_cache_dtype}
        ),
    )
    if rank == 0:
        progress_note(f"regenerate rank 0: generation engine built in {time.perf_counter() - built:.1f} s")
    bar = progress_bar(total=len(todo), unit="conv", desc=f"regenerate rank {rank}", disable=rank != 0)
    started = time.perf_counter()
    with open(cache, "a", encoding="utf-8") as file:
        sink = _CacheSink(file)
        regenerator = _Regenerator(engine, tokenizer, settings, max_length, template_kwargs, sink)
        for conv in todo:
            regenerator.start(conv)
        finished_before = len(regenerator.done)
        bar.update(finished_before)
        while engine.pending:
            for index, reply in engine.step():
                regenerator.accept(index, reply.tokens, reply.finished)
            bar.update(len(regenerator.done) - finished_before)
            finished_before = len(regenerator.done)
            seconds = time.perf_counter() - started
            bar.set_postfix_str(
                f"{engine.stats['generated_tokens'] / max(seconds, 1e-9):,.0f} tok/s, "
                f"{engine.stats['requests']} replies, {engine.running} running",
                refresh=False,
            )
        sink.sync()
    bar.close()
    timing.tokens, timing.seconds = engine.stats["generated_tokens"], time.perf_counter() - started
    timing.prefilled_tokens, timing.cached_tokens = engine.stats["prefill_tokens"], engine.stats["reused_prompt_tokens"]
    if rank == 0:
        progress_note(
            f"regenerate rank 0: prompts of {timing.prefilled_tokens + timing.cached_tokens:,} tokens, "
            f"{timing.prefilled_tokens:,} prefilled, {timing.cached_tokens:,} already cached by the "
            "conversation's earlier turn"
        )
    return regenerator.done


def _count(stats: RegenerateStats, entry: dict) -> None:
    if entry["messages"] is None:
        stats.kept += 1
        return
    stats.conversations += 1
    stats.replies += len(entry["reply_tokens"])
    stats.generated_tokens += sum(entry["reply_tokens"])
    stats.unfinished += entry["unfinished"]
    stats.cut += int(entry["cut"])
