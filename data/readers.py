"""Raw readers: turn one input file into a stream of ``(source, object)`` pairs.

A reader never raises for a bad *record*: it yields a `DataError` in the object's place so the caller
decides (raise, or skip and count). File-level problems that leave nothing to read (unsupported
type, missing column) raise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from .errors import DataError

CONTENT_FIELDS = ("messages", "conversations", "text")
# Reasons after which a reader yields nothing more from the file (what came before is kept).
STOP_REASONS = frozenset({"truncated_json", "unreadable_file"})
_READ_CHUNK = 1 << 20
_WHITESPACE = re.compile(r"[ \t\r\n]*")

Item = tuple[str, Any]  # (source "path:line", decoded object or DataError)


def read_jsonl(path: Path) -> Iterator[Item]:
    """One JSON value per line; blank lines are not records. A bad line does not stop the file."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            source = f"{path}:{line_no}"
            try:
                yield source, json.loads(raw)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                yield source, DataError(f"{source}: bad JSON ({e})", "bad_json")


class _CharBuffer:
    """A growing window on a text file, so records are decoded one by one without reading it all.

    The unconsumed part is at least doubled on every refill, so a record spanning many chunks costs
    amortised linear time.
    """

    def __init__(self, f: TextIO) -> None:
        self._f = f
        self.buf = ""
        self.pos = 0
        self.line = 1
        self.eof = False

    def more(self) -> bool:
        if self.eof:
            return False
        if self.pos > _READ_CHUNK:
            self.buf, self.pos = self.buf[self.pos :], 0
        chunk = self._f.read(max(_READ_CHUNK, len(self.buf) - self.pos))
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def advance(self, end: int) -> None:
        self.line += self.buf.count("\n", self.pos, end)
        self.pos = end

    def peek(self) -> str:
        """The next non-whitespace character ("" at end of file)."""
        while True:
            self.advance(_WHITESPACE.match(self.buf, self.pos).end())
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def decode(self, decoder: json.JSONDecoder) -> Any:
        """Decode the value at the cursor, reading more until it is complete or the file ends."""
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                if self.more():
                    continue
                raise
            if end == len(self.buf) and self.more():  # a bare number may go on in the next chunk
                continue
            self.advance(end)
            return value


def read_json(path: Path) -> Iterator[Item]:
    """A JSON array of records, or JSON values back to back (JSONL saved as .json).

    A truncated or malformed file yields the records before the damage, then one DataError with
    reason ``"truncated_json"`` naming the record number, and stops: nothing after it can be found.
    """
    decoder = json.JSONDecoder()
    try:
        with open(path, encoding="utf-8") as f:
            chars = _CharBuffer(f)
            in_array = chars.peek() == "["
            if in_array:
                chars.advance(chars.pos + 1)
            count = 0
            while True:
                c = chars.peek()
                if in_array and c == "]":
                    chars.advance(chars.pos + 1)
                    if chars.peek():
                        yield _stop(path, chars.line, count, "data after the closing ']'")
                    return
                if in_array and count and c == ",":
                    chars.advance(chars.pos + 1)
                    c = chars.peek()
                elif in_array and count and c:
                    yield _stop(path, chars.line, count, f"expected ',' or ']', found {c!r}")
                    return
                if not c:
                    if in_array:
                        yield _stop(path, chars.line, count, "file ends before the closing ']'")
                    return
                source = f"{path}:{chars.line}"
                try:
                    value = chars.decode(decoder)
                except json.JSONDecodeError as e:
                    yield _stop(path, chars.line, count, e.msg)
                    return
                count += 1
                yield source, value
    except UnicodeDecodeError as e:
        yield str(path), DataError(f"{path}: not UTF-8 text ({e.reason}); stopped reading the file", "unreadable_file")


def _stop(path: Path, line: int, count: int, what: str) -> Item:
    source = f"{path}:{line}"
    message = (
        f"{source}: record {count + 1}: truncated or malformed JSON ({what}); {count} records before it were decoded"
    )
    return source, DataError(message, "truncated_json")


def read_columnar(path: Path) -> Iterator[Item]:
    """Rows of a Parquet or Arrow IPC (file or stream, incl. Feather v2) file, reading only our columns."""
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"{path}: reading Parquet/Arrow needs pyarrow (pip install 'dflash-pipeline[parquet]')"
        ) from e
    try:
        if path.suffix == ".parquet":
            parquet = pq.ParquetFile(path)
            columns = _content_columns(path, parquet.schema_arrow.names)
            batches = parquet.iter_batches(batch_size=1024, columns=columns)
        else:
            source = pa.memory_map(str(path))
            try:
                ipc = pa.ipc.open_file(source)
                batches = (ipc.get_batch(i) for i in range(ipc.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                ipc = pa.ipc.open_stream(source)
                batches = iter(ipc)
            columns = _content_columns(path, ipc.schema.names)
        row = 0
        for batch in batches:
            for record in batch.select(columns).to_pylist():
                row += 1
                yield f"{path}:{row}", record
    except pa.ArrowException as e:
        yield (
            str(path),
            DataError(f"{path}: unreadable Arrow/Parquet data ({e}); stopped reading the file", "unreadable_file"),
        )


def _content_columns(path: Path, names: list[str]) -> list[str]:
    columns = [c for c in CONTENT_FIELDS if c in names]
    if not columns:
        raise DataError(f"{path}: no 'messages', 'conversations' or 'text' column (has {names})", "no_content_field")
    return columns


READERS = {
    ".jsonl": read_jsonl,
    ".json": read_json,
    ".parquet": read_columnar,
    ".arrow": read_columnar,
    ".feather": read_columnar,
}
