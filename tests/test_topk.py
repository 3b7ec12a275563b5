"""The target's top-K distribution in the store (`dflash-extract --store-topk K`, docs/FORMAT.md) and
the losses that read it (`dflash-train --loss kl|mix`): the store's round trip and version, the
extracted top-K against `torch.topk` of a reference forward, the KL against a dense reference, the
alignment of the stored rows with the block labels, and training with each loss."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from test_store import LAYOUT, make_batch, write_manifest_for
from test_train import base_config, losses

from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import run_extraction
from dflash_pipeline.shared.model.blocks import IGNORE_INDEX
from dflash_pipeline.shared.model.loss import dflash_loss, loss_weights, topk_kl
from dflash_pipeline.shared.store.errors import StoreMismatch
from dflash_pipeline.shared.store.manifest import Manifest, ManifestError, new_manifest
from dflash_pipeline.shared.store.reader import FeatureStore, stores_equal
from dflash_pipeline.shared.store.writer import StoreWriter
from dflash_pipeline.shared.target.loading import load_full_target
from dflash_pipeline.train.dataset import PackSpec, build_batch
from dflash_pipeline.train.packing import plan_packs
from dflash_pipeline.train.run import run_training
from dflash_pipeline.train.setup import StoreUnusable

K = 4


def topk_batch(seed: int, b: int) -> list[tuple]:
    """test_store's batch b with a top-K (ids int32, log-probs float32) beside each sample."""
    out = []
    for index, ids, mask, hidden in make_batch(seed, b):
        rng = np.random.default_rng([seed, b, index])
        logprobs = -np.sort(rng.exponential(3.0, (len(ids), K)).astype(np.float32), axis=1)
        out.append((index, ids, mask, hidden, rng.integers(0, 50_000, (len(ids), K)).astype(np.int32), logprobs))
    return out


def write_topk_store(root: Path, seed: int, n_batches: int) -> None:
    writer = StoreWriter(root, 0, hidden_dtype="bfloat16", topk=K, **LAYOUT)
    for b in range(writer.resume(), n_batches):
        writer.append_batch(topk_batch(seed, b))
    writer.finalize()
    write_manifest_for(root, complete=True, store_topk=K)


def test_store_round_trip_keeps_the_topk_bit_exact_and_says_so_in_its_version(tmp_path):
    write_topk_store(tmp_path, 3, 12)
    store = FeatureStore(tmp_path)
    samples = [s for b in range(12) for s in topk_batch(3, b)]
    assert store.num_tokens > 4 * LAYOUT["shard_tokens"] and store.store_topk == K
    for i, (index, ids, _, _, top_ids, top_logprobs) in enumerate(samples):
        got = store[i]
        assert got.sample_index == index and np.array_equal(got.input_ids.numpy(), ids)
        assert got.topk_ids.dtype == torch.int32 and np.array_equal(got.topk_ids.numpy(), top_ids)
        assert got.topk_logprobs.dtype == torch.float32 and np.array_equal(got.topk_logprobs.numpy(), top_logprobs)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert (raw["format_version"], raw["store_topk"]) == (3, K)
    group = zarr.open_group(tmp_path / "shards/rank-00000.zarr", mode="r")
    assert group.attrs["format_version"] == 3
    assert group["target_topk_ids"].dtype == np.int32 and group["target_topk_logprobs"].dtype == np.float32
    assert group["target_topk_ids"].shape == (store.num_tokens, K)
    write_topk_store(tmp_path / "again", 3, 12)
    assert stores_equal(tmp_path, tmp_path / "again")


def test_an_abandoned_topk_writer_resumes_to_the_same_store(tmp_path):
    """Rows of the partly written shard (top-K included) are read back on reopening; a writer asking
    for another K is refused."""
    write_topk_store(tmp_path / "straight", 5, 20)
    first = StoreWriter(tmp_path / "resumed", 0, hidden_dtype="bfloat16", topk=K, **LAYOUT)
    for b in range(13):
        first.append_batch(topk_batch(5, b))
    first.flush_shards()
    assert (
        0 < first.committed.batches < 13 and first.committed.tokens % LAYOUT["shard_tokens"]
    )  # a partly written shard to read back
    del first  # abandoned without finalize, as after a crash
    with pytest.raises(StoreMismatch, match="other settings \\(topk\\)"):
        StoreWriter(tmp_path / "resumed", 0, hidden_dtype="bfloat16", topk=K + 1, **LAYOUT)
    write_topk_store(tmp_path / "resumed", 5, 20)
    assert stores_equal(tmp_path / "straight", tmp_path / "resumed")


def test_manifests_without_topk_are_unchanged_and_versions_are_checked():
    m = new_manifest(
        target={
            "name_or_path": "t",
            "architecture": "A",
            "config_hash": "h",
            "num_layers": 2,
            "hidden_size": 4,
            "layer_ids": [1],
            "vocab_size": 10,
        },
        hidden_dtype="bfloat16",
        world_size=1,
    )
    d = m.to_dict()
    assert "store_topk" not in d and d["format_version"] == 1  # the bytes of stores made before top-k
    assert Manifest.from_dict(d).store_topk == 0
    fp8 = {**d, "hidden_dtype": "float8_e4m3fn", "storage_dtype": "uint8", "format_version": 2}
    assert Manifest.from_dict({**fp8, "store_topk": 16, "format_version": 3}).store_topk == 16
    with pytest.raises(ManifestError, match="format_version 3 does not hold"):
        Manifest.from_dict({**d, "format_version": 3})
    with pytest.raises(ManifestError, match="format_version 1 does not hold"):
        Manifest.from_dict({**d, "store_topk": 16})


def test_writer_wants_the_topk_exactly_when_asked(tmp_path):
    writer = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", topk=K, **LAYOUT)
    with pytest.raises(ValueError, match="with top-4 takes 5 arrays a sample"):
        writer.append_batch(make_batch(0, 0))
    index, ids, mask, hidden, top_ids, logprobs = topk_batch(0, 0)[0]
    with pytest.raises(ValueError, match="topk logprobs must be float32"):
        writer.append_batch([(index, ids, mask, hidden, top_ids, logprobs.astype(np.float16))])


def test_kl_equals_a_dense_reference_on_a_hand_made_example():
    """Two blocks of B = 4 over a vocabulary of 6; the stored top-3 renormalised against the drafter's
    full softmax, weighted like the CE, computed densely in float64."""
    torch.manual_seed(0)
    B, V, H, k = 4, 6, 5, 3
    hidden = torch.randn(1, 2 * B, H)
    head = torch.randn(V, H)
    labels = torch.tensor([[IGNORE_INDEX, 2, 5, IGNORE_INDEX, IGNORE_INDEX, 0, 1, IGNORE_INDEX]])
    ids = torch.tensor([[2, 0, 4], [5, 2, 1], [1, 3, 0], [4, 2, 1]], dtype=torch.int32)
    logprobs = torch.tensor([[-0.2, -2.0, -3.0], [-0.7, -1.1, -4.0], [-1.0, -1.5, -1.6], [-0.1, -3.0, -9.0]])
    rows = [1, 2, 5, 6]  # the labeled rows get the stored rows; the rest are zeros, never read
    full_ids = torch.zeros(1, 2 * B, k, dtype=torch.int32)
    full_logprobs = torch.zeros(1, 2 * B, k)
    full_ids[0, rows], full_logprobs[0, rows] = ids, logprobs

    q = torch.log_softmax((hidden[0].double() @ head.double().T), dim=-1)
    weights = loss_weights(B, 2.0).double().repeat(2)
    kl_sum = ce_sum = 0.0
    for j, r in enumerate(rows):
        p = torch.zeros(V, dtype=torch.float64)
        p[ids[j].long()] = logprobs[j].double().exp()
        p /= p.sum()
        present = p > 0
        kl_sum += weights[r] * (p[present] * (p[present].log() - q[r][present])).sum()
        ce_sum += weights[r] * -q[r, labels[0, r]]
    denominator = weights[rows].sum()
    args = (hidden, labels, head, B, 2.0)
    kl, stats = dflash_loss(*args, target_topk=(full_ids, full_logprobs), kl_weight=1.0)
    assert kl.item() == pytest.approx((kl_sum / denominator).item(), rel=1e-5)
    mix, _ = dflash_loss(*args, target_topk=(full_ids, full_logprobs), kl_weight=0.25)
    assert mix.item() == pytest.approx((0.75 * ce_sum / denominator + 0.25 * kl_sum / denominator).item(), rel=1e-5)
    ce, _ = dflash_loss(*args)
    assert torch.equal(dflash_loss(*args, target_topk=(full_ids, full_logprobs), kl_weight=0.0)[0], ce)
    # the KL of the target's own (renormalised) distribution is 0
    own = torch.full((1, V), -30.0)
    own[0, ids[0].long()] = logprobs[0]
    assert topk_kl(own, ids[:1], logprobs[:1]).abs().item() < 1e-6
    assert stats["total"].sum() == 4


# uncompressed, small chunks
SMALL = dict(compression="none", chunk_tokens=32, shard_tokens=256)


@pytest.fixture(scope="module")
def stores(extract_cpu_store, small_corpus, tmp_path_factory) -> dict[int, Path]:
    """The same corpus extracted without and with the top-K (float32 compute on CPU)."""
    return {
        topk: extract_cpu_store(
            small_corpus, tmp_path_factory.mktemp(f"topk{topk}") / "store", store_topk=topk, **SMALL
        )
        for topk in (0, K)
    }


def test_extracted_topk_is_torch_topk_of_a_reference_forward(stores, tiny_target_dir):
    plain, topk = FeatureStore(stores[0]), FeatureStore(stores[K])
    assert plain.store_topk == 0 and topk.store_topk == K and len(plain) == len(topk)
    model = load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)
    for i in range(len(topk)):
        want, got = plain[i], topk[i]
        # the states are those of the truncated target's store, bit for bit
        assert torch.equal(want.hidden_states.view(torch.uint16), got.hidden_states.view(torch.uint16)), i
        with torch.no_grad():
            logits = model(input_ids=got.input_ids[None]).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1).topk(K, dim=-1)
        assert torch.equal(got.topk_ids, ref.indices.to(torch.int32)), i
        torch.testing.assert_close(got.topk_logprobs, ref.values, rtol=0, atol=1e-5)


def test_batches_carry_the_topk_that_predicts_each_label(stores):
    store = FeatureStore(stores[K])
    spec = PackSpec(pack_tokens=256, num_blocks=16, block_size=8, mask_token_id=0, max_anchors_per_sample=64, topk=K)
    packs = plan_packs(np.arange(len(store)), np.asarray(store.lengths), 256, 0, 0)[:2]
    batch = build_batch(store, packs, spec, 0, 0)
    plain = build_batch(store, packs, replace(spec, topk=0), 0, 0)
    assert sorted(batch) == sorted([*plain, "target_topk_ids", "target_topk_logprobs"])
    for key in plain:
        assert torch.equal(plain[key], batch[key]), key
    checked = 0
    for j, pack in enumerate(packs):
        context_ids = torch.cat([store[i].topk_ids for i in pack])[: spec.pack_tokens]
        context_logprobs = torch.cat([store[i].topk_logprobs for i in pack])[: spec.pack_tokens]
        labels = batch["labels"][j].view(-1, spec.block_size)
        ids = batch["target_topk_ids"][j].view(*labels.shape, K)
        logprobs = batch["target_topk_logprobs"][j].view(*labels.shape, K)
        for n, a in enumerate(batch["anchor_pos"][j].tolist()):
            for k in range(spec.block_size):
                if labels[n, k] == IGNORE_INDEX:
                    assert not ids[n, k].any() and not logprobs[n, k].any()
                    continue
                # the label is token a+k; the target predicted it at a+k-1
                assert torch.equal(ids[n, k], context_ids[a + k - 1])
                assert torch.equal(logprobs[n, k], context_logprobs[a + k - 1])
                checked += 1
    assert checked > 100


def test_topk_is_part_of_the_store_identity(stores, tiny_target_dir, small_corpus):
    from dflash_pipeline.extract.run import ExtractError

    for root, topk in ((stores[0], K), (stores[K], K + 1), (stores[K], 0)):
        cfg = ExtractConfig(
            target=str(tiny_target_dir),
            data=(str(small_corpus),),
            out=str(root),
            device="cpu",
            store_topk=topk,
            **SMALL,
        )
        with pytest.raises(ExtractError, match="other settings .*store_topk: "):
            run_extraction(cfg)


def test_loss_options_are_checked():
    from dflash_pipeline.shared.runtime.config import ConfigError
    from dflash_pipeline.train.config import TrainConfig

    base = TrainConfig(store="s", out="o")
    assert (base.loss, base.kl_weight) == ("ce", 0.5)
    for bad, option in [(dict(loss="kld"), "--loss"), (dict(kl_weight=1.5), "--kl-weight")]:
        with pytest.raises(ConfigError, match=option):
            TrainConfig(store="s", out="o", **bad)
    assert ExtractConfig(target="t", data=("d",), out="o").store_topk == 0
    with pytest.raises(ConfigError, match="--store-topk"):
        ExtractConfig(target="t", data=("d",), out="o", store_topk=-1)


def test_kl_needs_a_store_with_topk(stores, tmp_path):
    for loss in ("kl", "mix"):
        with pytest.raises(StoreUnusable, match=f"--loss {loss} needs the target's top-k distribution") as info:
            run_training(base_config(stores[0], tmp_path / loss, loss=loss, max_steps=1))
        assert "\n" not in str(info.value)


def test_training_with_each_loss(stores, tmp_path):
    """ce on a top-K store is ce on the plain store, bit for bit (the top-K is not even loaded); mix
    with weight 0 is ce; kl trains (its loss falls) and differs from ce."""
    runs = {
        "plain": (stores[0], {}),
        "ce": (stores[K], {}),
        "mix0": (stores[K], dict(loss="mix", kl_weight=0.0)),
        "kl": (stores[K], dict(loss="kl")),
        "mix": (stores[K], dict(loss="mix", kl_weight=0.5, loader_workers=1)),  # through the slot ring
    }
    got = {}
    for name, (root, kw) in runs.items():
        run_training(replace(base_config(root, tmp_path / name), max_steps=12, lr=3e-3, eval_every=12, **kw))
        got[name] = losses(tmp_path / name)
    assert got["ce"] == got["plain"] == got["mix0"]
    assert got["kl"][12] < got["kl"][1] and got["kl"] != got["ce"]
    assert got["mix"][12] < got["mix"][1]
    # step 1 (same drafter): the mix is halfway between ce and kl
    assert got["mix"][1] == pytest.approx(0.5 * (got["ce"][1] + got["kl"][1]), rel=1e-4)


def test_dflash2_kl_replaces_only_the_draft_term(stores, tmp_path):
    runs = {}
    for loss in ("ce", "kl"):
        runs[loss] = tmp_path / loss
        run_training(replace(base_config(stores[K], runs[loss], arch="dflash2", loss=loss), max_steps=2))
    from dflash_pipeline.train.metrics import read_records

    first = {loss: read_records(run / "metrics.jsonl")[0][0] for loss, run in runs.items()}
    # same drafter at step 1: the selector's term is the same, the draft term differs
    assert first["kl"]["selector_loss"] == pytest.approx(first["ce"]["selector_loss"], rel=1e-6)
    assert first["kl"]["ce_loss"] != pytest.approx(first["ce"]["ce_loss"], rel=1e-3)
