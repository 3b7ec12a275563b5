"""Checks and lookups stage two does on the store before it builds anything."""

from __future__ import annotations

import numpy as np
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.shared.target.identity import TargetIdentity, check_config, check_weights, config_hash
from dflash_pipeline.shared.target.loading import text_config


class StoreUnusable(UserError, ValueError):
    """The store cannot train a drafter with these settings."""


def load_target_config(store: FeatureStore) -> PretrainedConfig:
    return text_config(AutoConfig.from_pretrained(str(StoreLayout(store.root).target_dir)))


def store_identity(store: FeatureStore) -> dict:
    """What a checkpoint must share with the store it resumes on."""
    m = store.manifest
    return {
        "config_hash": m.target["config_hash"],
        "layer_ids": list(m.target["layer_ids"]),
        "data_fingerprint": m.data["fingerprint"],
        "weights_fingerprint": m.target.get("weights_fingerprint"),
    }


def check_store_target(store: FeatureStore, target: str) -> None:
    """Refuse a store not extracted from `target` (`--target`): other config or other weights."""
    from dflash_pipeline.shared.target.loading import load_target_config as load_cfg

    identity = TargetIdentity.of_store(store.root, store.manifest.target)
    check_config(identity, f"the store {store.root}", target, config_hash(load_cfg(target)))
    check_weights(identity, f"the store {store.root}", target)


def validate_store(store: FeatureStore, cfg) -> None:
    """Refuse, with one line, a store that cannot train this drafter."""
    if len(store) == 0:
        raise StoreUnusable(f"{store.root}: the store holds no samples")
    longest = int(max(store.lengths))
    if longest < cfg.block_size + 1:
        raise StoreUnusable(
            f"{store.root}: block size {cfg.block_size} is larger than every sample (longest has {longest} tokens); "
            "lower --block-size"
        )
    if getattr(cfg, "loss", "ce") != "ce" and not store.store_topk:
        raise StoreUnusable(
            f"{store.root}: --loss {cfg.loss} needs the target's top-k distribution, which this store does not "
            "hold; extract it with dflash-extract --store-topk K, or train with --loss ce"
        )


def resolve_mask_token(store: FeatureStore, given: int | None) -> int:
    """The token whose embedding fills the masked block positions.

    Order: the explicit id; the tokenizer's mask token; the first embedding row past the tokenizer's
    vocabulary (padded vocabularies, as Qwen3's, have unused rows: the reference drafters use one).
    """
    vocab = load_target_config(store).vocab_size
    if given is not None:
        if not 0 <= given < vocab:
            raise StoreUnusable(f"--mask-token-id {given} is outside the target vocabulary (0..{vocab - 1})")
        return given
    tok = AutoTokenizer.from_pretrained(str(StoreLayout(store.root).tokenizer_dir))
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    if len(tok) < vocab:
        return len(tok)
    offered = ", ".join(f"{i} ({tok.convert_ids_to_tokens(i)})" for i in special_ids_no_sample_holds(store, tok)[:5])
    raise StoreUnusable(
        f"{store.root}: the tokenizer has no mask token and no unused embedding rows; pass --mask-token-id "
        + (f"with a special token no stored sample holds, e.g. {offered}" if offered else "(a rarely used token)")
    )


def special_ids_no_sample_holds(store: FeatureStore, tok: PreTrainedTokenizerBase, chunk: int = 1 << 24) -> list[int]:
    """The tokenizer's special tokens that occur in no stored sample: the safest stand-ins for a mask
    token (one the samples use would give the drafter's masked positions a meaning of their own).
    Reads the stored ids `chunk` tokens at a time."""
    held: set[int] = set()
    for shard, entry in enumerate(store.shards):
        for start in range(0, entry.tokens, chunk):
            ids, _ = store.read_ids_and_mask(shard, start, min(start + chunk, entry.tokens))
            held.update(np.unique(ids).tolist())
    special = sorted(i for i, added in tok.added_tokens_decoder.items() if added.special)
    return [i for i in special if i not in held]
