"""`tokenize_record` over many records in worker processes.

Rendering a conversation's chat template (once per message, to find the reply spans) and tokenizing
it is pure-Python work (one process tokenized 313 multi-turn conversations a second on the H100 machine),
and a rank's share of a large dataset would keep its GPU idle for minutes. The results are
`tokenize_record`'s, in the records' order, whatever the number of processes; a record it refuses
comes back as its `DataError`, for the caller to count or raise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dflash_pipeline.shared.runtime.launch import die_with_parent

from .errors import DataError
from .records import Record
from .tokens import TokenizedSample, tokenize_record

# records one worker must have to pay for its start (a spawned process imports transformers: ~2 s,
# the time of ~700 records)
RECORDS_PER_PROCESS = 1000
SCRATCH_PREFIX = "dflash-tokenize-"  # then the host, the rank's pid and tempfile's random part

_worker: dict[str, Any] = {}


def tokenize_processes(records: int, ranks_on_host: int) -> int:
    """Processes for `records` records: the rank's share of the host's cores (one kept for the rank),
    at most one per `RECORDS_PER_PROCESS`; 1 tokenizes in the calling process."""
    share = max(1, (os.cpu_count() or 1) // max(1, ranks_on_host) - 1)
    return max(1, min(share, records // RECORDS_PER_PROCESS))


def tokenize_many(
    records: Sequence[Record],
    tokenizer: Any,
    max_length: int | None,
    processes: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Iterator[TokenizedSample | DataError]:
    """Each record's `tokenize_record` result or `DataError`, in order, from `processes` spawned
    workers (the caller may have started CUDA, which a forked child must not inherit). The first
    record is tokenized here, so a target that cannot tokenize at all fails in this process."""
    if not records:
        return
    yield _attempt(records[0], tokenizer, max_length, chat_template_kwargs)
    rest = records[1:]
    if processes <= 1:
        yield from (_attempt(r, tokenizer, max_length, chat_template_kwargs) for r in rest)
        return
    chunk = max(1, min(64, len(rest) // (processes * 8)))  # small enough to balance, large enough to batch
    # The tokenizer reaches the workers through a file: a spawned child reads its start arguments only
    # after importing the caller's main module (seconds: torch, transformers), and arguments larger than
    # a pipe's buffer (a pickled tokenizer is megabytes) would make each start wait for the one before.
    remove_orphaned_scratch()
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{socket.gethostname()}-{os.getpid()}-") as scratch:
        tokenizer_file = os.path.join(scratch, "tokenizer.pickle")
        with open(tokenizer_file, "wb") as f:
            pickle.dump(tokenizer, f)
        with mp.get_context("spawn").Pool(
            processes,
            initializer=_start_worker,
            initargs=(os.getpid(), tokenizer_file, max_length, chat_template_kwargs),
        ) as pool:
            for outcome in pool.imap(_attempt_in_worker, rest, chunksize=chunk):
                yield DataError(*outcome) if isinstance(outcome, tuple) else outcome


def remove_orphaned_scratch() -> None:
    """Remove the tokenizer files that ranks of this host which no longer run left behind: a rank
    killed (kill -9, the OOM killer) cannot remove its own, and a real tokenizer pickles to megabytes."""
    host_prefix = f"{SCRATCH_PREFIX}{socket.gethostname()}-"
    for scratch in Path(tempfile.gettempdir()).glob(f"{host_prefix}*"):
        pid = scratch.name[len(host_prefix) :].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _attempt(record, tokenizer, max_length, chat_template_kwargs) -> TokenizedSample | DataError:
    try:
        return tokenize_record(record, tokenizer, max_length, chat_template_kwargs=chat_template_kwargs)
    except DataError as exc:
        return exc


def _start_worker(parent, tokenizer_file, max_length, chat_template_kwargs) -> None:
    # A rank killed while it holds the pool's task-queue lock (closing the pool takes it) would leave
    # workers waiting for that lock forever: they die with the rank instead.
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the rank's to act on: it ends the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    with open(tokenizer_file, "rb") as f:
        tokenizer = pickle.load(f)
    _worker.update(tokenizer=tokenizer, max_length=max_length, chat_template_kwargs=chat_template_kwargs)


def _attempt_in_worker(record: Record) -> TokenizedSample | tuple[str, str]:
    """A refusal travels as (message, reason): a `DataError` does not survive pickling (its reason is
    not among its args)."""
    outcome = _attempt(record, _worker["tokenizer"], _worker["max_length"], _worker["chat_template_kwargs"])
    return (str(outcome), outcome.reason) if isinstance(outcome, DataError) else outcome
