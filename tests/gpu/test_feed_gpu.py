"""The trainer's feed on CUDA: page-locked slots, one DMA copy per batch, slots reused safely.

Run on the GPU machine: `python -m pytest tests/gpu -q`.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import run_extraction
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.dataset import PackSpec, StepDataset, StepPlan, build_batch
from dflash_pipeline.train.feed import device_batches, slots_needed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def sample_store(target: Path, tmp_path: Path, **extract) -> Path:
    """A store of the sample corpus's first 64 conversations, extracted on the CPU into tmp_path/store."""
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(sample_corpus_path().read_text().splitlines()[:64]) + "\n")
    store = tmp_path / "store"
    run_extraction(
        ExtractConfig(target=str(target), data=(str(data),), out=str(store), device="cpu", max_length=256, **extract)
    )
    return store


@pytest.mark.parametrize(
    "workers, prefetch, store_dtype", [(1, 1, "bfloat16"), (2, 2, "bfloat16"), (2, 2, "float8_e4m3fn")]
)
def test_cuda_batches_equal_in_process_batches_through_reused_pinned_slots(
    tiny_target_dir, tmp_path, monkeypatch, workers, prefetch, store_dtype
):
    """Every batch kept on the device and compared at the end, while the current stream is kept
    busy (as a training step would) so copies on the feed's stream run beside it: a slot refilled
    before its copy finished, or a batch read before its copy landed, shows as a mismatch. An fp8
    store's batches carry codes and scales (compared as bytes)."""
    store = FeatureStore(sample_store(tiny_target_dir, tmp_path, batch_tokens=2048, store_dtype=store_dtype))
    plan = StepPlan(np.arange(len(store)), np.asarray(store.lengths), 256, seed=1, rank=0, world=1, packs_per_step=2)
    spec = PackSpec(256, 16, 8, 0, 512)
    schedule = plan.schedule(8)[:12]
    assert len(schedule) > 3 * slots_needed(1, 1)
    dataset = StepDataset(str(tmp_path / "store"), plan, spec)
    rings, with_slots = [], StepDataset.with_slots  # the ring the feed hands the workers' copy of the dataset
    monkeypatch.setattr(StepDataset, "with_slots", lambda self, slots: rings.append(slots) or with_slots(self, slots))
    device = torch.device("cuda")
    got = []
    for epoch, k, batch in device_batches(dataset, schedule, workers, device, prefetch=prefetch):
        assert all(buffer.is_pinned() for buffer in rings[0].buffers)
        torch.cuda._sleep(20_000_000)  # ~10 ms of "step" queued on the current stream
        got.append((epoch, k, batch))
    assert [(e, k) for e, k, _ in got] == schedule and dataset.slots is None
    for epoch, k, batch in got:
        want = build_batch(store, plan.epoch_packs(epoch)[2 * k : 2 * k + 2], spec, 1, epoch)
        assert batch.keys() == want.keys()
        for key, value in want.items():
            got_bytes, want_bytes = batch[key].cpu().view(torch.uint8), value.view(torch.uint8)
            assert batch[key].device.type == "cuda" and torch.equal(got_bytes, want_bytes), (epoch, k, key)
