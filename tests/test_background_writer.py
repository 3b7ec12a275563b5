"""The extraction's I/O thread: same store as synchronous appends, errors surface, nothing after an
error commits."""

from __future__ import annotations

import numpy as np
import pytest
from test_store import LAYOUT, make_batch, write_manifest_for, write_store

from dflash_pipeline.extract.background_writer import BackgroundWriter
from dflash_pipeline.shared.store.reader import stores_equal
from dflash_pipeline.shared.store.writer import StoreWriter


def test_background_appends_give_the_synchronous_store(tmp_path):
    write_store(tmp_path / "sync", 3, 40)
    writer = StoreWriter(tmp_path / "bg", 0, hidden_dtype="bfloat16", compression="zstd:1", **LAYOUT)
    with BackgroundWriter(writer, depth=1) as sink:
        for b in range(40):
            sink.submit(make_batch(3, b))
    writer.finalize()
    for root in ("sync", "bg"):
        write_manifest_for(tmp_path / root, complete=True)
    assert stores_equal(tmp_path / "sync", tmp_path / "bg")


def test_a_failed_append_is_raised_and_later_batches_are_not_committed(tmp_path):
    writer = StoreWriter(tmp_path / "s", 0, hidden_dtype="bfloat16", compression="none", **LAYOUT)
    sink = BackgroundWriter(writer, depth=4)
    sink.submit(make_batch(0, 0))
    bad = make_batch(0, 1)
    bad[0] = (bad[0][0], bad[0][1], np.full(len(bad[0][1]) + 1, 1, np.uint8), bad[0][3])  # mask longer than ids
    sink.submit(bad)
    for b in range(2, 30):
        try:
            sink.submit(make_batch(0, b))
        except ValueError:
            break
    with pytest.raises(ValueError, match="loss_mask must be 0/1 of shape"):
        sink.close()
    assert writer.committed.batches <= 1
