"""Records -> token ids and loss masks, through the target tokenizer.

Conversations: the chat template's text, tokenized without extra special tokens (the template
writes them); ``loss_mask`` is 1 on every token that carries a character of an assistant reply span
(`dflash_pipeline.data.chat` defines the span: reply content plus the end-of-turn token(s) closing it).
Plain ``text`` records: tokenized with the tokenizer's usual special tokens (e.g. a BOS), and every
token gets loss 1 -- there is no prompt to exclude.

Samples longer than ``max_length`` are cut (``truncated``); a sample left with no loss token is a bad
record (reason ``no_loss_tokens``): it would train nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chat import render_with_reply_spans
from .errors import DataError, TokenizerError
from .records import ReadStats, Record

__all__ = ["TokenizedSample", "tokenize_record", "tokenize_records"]


@dataclass(frozen=True)
class TokenizedSample:
    index: int
    input_ids: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # uint8 [S], 1 where the token is a training label
    truncated: bool


def tokenize_record(
    record: Record, tokenizer: Any, max_length: int | None, *, chat_template_kwargs: dict[str, Any] | None = None
) -> TokenizedSample:
    """Tokenize one record (see module doc), rendering conversations with the template options
    `chat_template_kwargs`; raises `DataError` for a sample with no loss token."""
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("a fast (tokenizers-backed) tokenizer is needed for offset mapping")
    if record.messages is not None:
        if not tokenizer.chat_template:
            raise TokenizerError(
                f"{record.source}: a conversation, but the target's tokenizer has no chat template "
                "(add chat_template.jinja or tokenizer_config.json's chat_template to the target folder)"
            )
        text, spans = render_with_reply_spans(
            tokenizer, record.messages, record.source, template_kwargs=chat_template_kwargs
        )
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int32)
        mask = _span_mask(np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2), spans)
    else:
        ids = np.asarray(tokenizer(record.text, add_special_tokens=True)["input_ids"], dtype=np.int32)
        mask = np.ones(len(ids), dtype=np.uint8)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        where = f"within max_length={max_length}" if truncated else "at all"
        raise DataError(f"{record.source}: no assistant-reply tokens {where}", "no_loss_tokens")
    return TokenizedSample(record.index, ids, mask, bool(truncated))


def _span_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose characters overlap a span. A space token whose offsets a ByteLevel
    post-processor trimmed to zero width (p, p) stands for character p-1: overlap (lo < p < hi)
    puts it on the right side of each boundary."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return mask.astype(np.uint8)


def tokenize_records(
    records: Iterable[Record],
    tokenizer: Any,
    max_length: int | None,
    *,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Iterator[TokenizedSample]:
    """`tokenize_record` over a stream, counting samples and truncations, skipping bad ones if asked."""
    stats = stats if stats is not None else ReadStats()
    for record in records:
        try:
            sample = tokenize_record(record, tokenizer, max_length, chat_template_kwargs=chat_template_kwargs)
        except DataError as e:
            if not skip_bad:
                raise
            stats.skip(e)
            continue
        stats.samples += 1
        stats.truncated += sample.truncated
        yield sample
