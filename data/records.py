"""Reading chat and text records from JSONL / JSON / Parquet / Arrow files or a directory of them.

Accepted record shapes (one per record; exactly one of the three fields, `null` counts as absent):

- ``{"messages": [{"role": "system"|"user"|"assistant", "content": str | [{"type": "text",
  "text": str}, ...]}, ...]}`` (OpenAI). List content is joined with "\\n". An assistant turn may
  carry ``"unfinished": true``: its reply was cut by a length limit (a server's ``finish_reason:
  "length"``), so the template's end-of-turn after it is not a label (`dflash_pipeline.data.chat`).
- ``{"conversations": [{"from": ..., "value": str}, ...]}`` (ShareGPT); ``from`` maps
  human/user -> user, gpt/assistant/chatgpt/bing/bard -> assistant, system -> system.
- ``{"text": str}``: plain text.

A conversation needs at least one assistant turn, and every turn non-empty content. Read as prompts
(``prompts=True``, for decoding), a conversation needs no assistant turn and ``{"prompt": str}``
(JSON/JSONL; only when none of the three fields is present) is one user turn. Anything else
is a bad record: `DataError` naming ``file:line`` (row number for Parquet/Arrow), or, with
``skip_bad``, skipped and counted in `ReadStats.skipped` by reason code:

``bad_json`` (line is not JSON), ``not_an_object``, ``no_content_field``, ``ambiguous_fields``,
``wrong_type``, ``empty_conversation``, ``empty_content``, ``empty_text``, ``unknown_role``,
``unsupported_content`` (a non-text content part), ``no_assistant_turn``, and the two after which a
file is abandoned: ``truncated_json`` (a .json file that cannot be decoded further; the records
before it are kept and their count is in `ReadStats.recovered`) and ``unreadable_file``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat import UNFINISHED
from .errors import DataError
from .readers import CONTENT_FIELDS, READERS, STOP_REASONS

__all__ = ["DataError", "ReadStats", "Record", "data_files", "iter_records"]

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Record:
    """One usable record. `index` counts yielded records from 0 across all files of the input, so it
    is deterministic for a given input and ``skip_bad`` setting; `source` is ``"path:line"``."""

    index: int
    source: str
    messages: list[dict[str, Any]] | None = None
    text: str | None = None


@dataclass
class ReadStats:
    """What reading (and, through `tokenize_records`, tokenizing) did: nothing is dropped unseen."""

    files: list[str] = field(default_factory=list)
    records: int = 0  # records yielded by iter_records
    skipped: Counter = field(default_factory=Counter)  # reason code -> bad records skipped
    recovered: dict[str, int] = field(default_factory=dict)  # abandoned file -> records decoded first
    samples: int = 0  # records tokenized (tokenize_records)
    truncated: int = 0  # samples cut to max_length (tokenize_records)
    first_skipped: str | None = None  # the first bad record's message, to show what was wrong

    def skip(self, error: DataError) -> None:
        self.skipped[error.reason] += 1
        if self.first_skipped is None:
            self.first_skipped = str(error)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line for a run summary."""
        parts = [f"{len(self.files)} files", f"{self.records} records"]
        if self.samples:
            parts.append(f"{self.samples} samples ({self.truncated} truncated)")
        if self.skipped:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
            parts.append(f"{self.skipped_total} skipped ({reasons})")
        for path, count in sorted(self.recovered.items()):
            parts.append(f"{path}: stopped after {count} records")
        return "; ".join(parts)


def data_files(path: str | Path) -> list[Path]:
    """The data files `path` stands for: itself, or a directory's supported files (recursively,
    hidden names ignored) sorted by relative path so record order never depends on the file system."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            (
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix in READERS
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise DataError(f"{path}: no data files ({', '.join(READERS)}) in this directory", "no_data_files")
        return files
    if not path.exists():
        raise DataError(f"{path}: no such file or directory", "missing_file")
    if path.suffix not in READERS:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (use {', '.join(READERS)})", "unsupported_file")
    return [path]


def iter_records(
    path: str | Path, *, skip_bad: bool = False, stats: ReadStats | None = None, prompts: bool = False
) -> Iterator[Record]:
    """Yield the records of a file or directory in order; bad records raise `DataError` or, with
    `skip_bad`, are counted in `stats` by reason. `prompts`: read prompts to decode from, not
    training data (see the module docstring)."""
    stats = stats if stats is not None else ReadStats()
    index = 0
    for file in data_files(path):
        stats.files.append(str(file))
        decoded = 0
        for source, item in READERS[file.suffix](file):
            if isinstance(item, DataError):
                error = item
                if error.reason in STOP_REASONS:
                    stats.recovered[str(file)] = decoded
            else:
                decoded += 1
                try:
                    record = _to_record(index, source, item, prompts)
                except DataError as e:
                    error = e
                else:
                    index += 1
                    stats.records += 1
                    yield record
                    continue
            if not skip_bad:
                raise error
            stats.skip(error)


def _to_record(index: int, source: str, obj: Any, prompts: bool) -> Record:
    if not isinstance(obj, dict):
        raise DataError(f"{source}: record is a {type(obj).__name__}, not an object", "not_an_object")
    present = [k for k in CONTENT_FIELDS if obj.get(k) is not None]
    if prompts and not present and obj.get("prompt") is not None:
        prompt = _content(obj["prompt"], f"{source}: prompt")
        return Record(index, source, messages=[{"role": "user", "content": prompt}])
    if not present:
        fields = (*CONTENT_FIELDS, "prompt") if prompts else CONTENT_FIELDS
        raise DataError(f"{source}: record has none of {', '.join(map(repr, fields))}", "no_content_field")
    if len(present) > 1:
        raise DataError(f"{source}: record has both {present[0]!r} and {present[1]!r}", "ambiguous_fields")
    kind = present[0]
    if kind == "text":
        text = obj["text"]
        if not isinstance(text, str):
            raise DataError(f"{source}: 'text' is a {type(text).__name__}, not a string", "wrong_type")
        if not text.strip():
            raise DataError(f"{source}: empty 'text'", "empty_text")
        return Record(index, source, text=text)
    turns = obj[kind]
    if not isinstance(turns, list):
        raise DataError(f"{source}: {kind!r} is a {type(turns).__name__}, not a list", "wrong_type")
    if not turns:
        raise DataError(f"{source}: {kind!r} is empty", "empty_conversation")
    parse = _openai_turn if kind == "messages" else _sharegpt_turn
    messages = [parse(turn, f"{source}: turn {n}") for n, turn in enumerate(turns, 1)]
    if not prompts and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{source}: conversation has no assistant turn", "no_assistant_turn")
    return Record(index, source, messages=messages)


def _openai_turn(turn: Any, where: str) -> dict[str, Any]:
    role, content = _fields(turn, "role", "content", where)
    if role not in ROLES:
        raise DataError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})", "unknown_role")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, where) for part in content)
    message: dict[str, Any] = {"role": role, "content": _content(content, where)}
    unfinished = turn.get(UNFINISHED)
    if unfinished is not None:
        if not isinstance(unfinished, bool):
            raise DataError(f"{where}: {UNFINISHED!r} is a {type(unfinished).__name__}, not a boolean", "wrong_type")
        if role != "assistant":
            raise DataError(f"{where}: {UNFINISHED!r} on a {role} turn (it marks a cut assistant reply)", "wrong_type")
        if unfinished:
            message[UNFINISHED] = True
    return message


def _sharegpt_turn(turn: Any, where: str) -> dict[str, str]:
    speaker, value = _fields(turn, "from", "value", where)
    role = SHAREGPT_ROLES.get(speaker.lower())
    if role is None:
        raise DataError(
            f"{where}: unknown speaker {speaker!r} (expected one of {', '.join(SHAREGPT_ROLES)})", "unknown_role"
        )
    return {"role": role, "content": _content(value, where)}


def _fields(turn: Any, role_key: str, content_key: str, where: str) -> tuple[str, Any]:
    if not isinstance(turn, dict):
        raise DataError(f"{where}: is a {type(turn).__name__}, not an object", "wrong_type")
    role = turn.get(role_key)
    if not isinstance(role, str):
        raise DataError(f"{where}: {role_key!r} missing or not a string", "wrong_type")
    return role, turn.get(content_key)


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise DataError(
            f"{where}: content part of type {kind!r}; only 'text' parts are supported", "unsupported_content"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise DataError(f"{where}: text part without a string 'text'", "wrong_type")
    return text


def _content(content: Any, where: str) -> str:
    if not isinstance(content, str):
        raise DataError(
            f"{where}: content is a {type(content).__name__}, not a string",
            "wrong_type" if content is not None else "empty_content",
        )
    if not content.strip():
        raise DataError(f"{where}: empty content", "empty_content")
    return content
