"""Which token fills the drafter's masked block positions: `resolve_mask_token` on a real store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.setup import StoreUnusable, resolve_mask_token


def edited_copy(store: Path, tmp_path: Path, *, mask_token: bool = True, vocab_size: int | None = None) -> FeatureStore:
    """The store with its tokenizer's mask token dropped and/or the target's vocabulary resized."""
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    layout = StoreLayout(copy)
    if not mask_token:
        path = layout.tokenizer_dir / "tokenizer_config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "mask_token"}))
    if vocab_size is not None:
        path = layout.target_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "vocab_size": vocab_size}))
    return FeatureStore(copy)


def test_the_given_id_then_the_tokenizers_mask_token_then_the_first_unused_row(store, tmp_path):
    assert resolve_mask_token(FeatureStore(store), 7) == 7
    assert resolve_mask_token(FeatureStore(store), None) == 4  # the tiny tokenizer's <|mask|>
    assert resolve_mask_token(edited_copy(store, tmp_path, mask_token=False, vocab_size=800), None) == 768


def test_an_id_outside_the_vocabulary_is_refused(store):
    with pytest.raises(StoreUnusable, match=r"--mask-token-id 768 is outside the target vocabulary \(0..767\)"):
        resolve_mask_token(FeatureStore(store), 768)


def test_without_a_mask_token_or_a_spare_row_the_error_names_special_tokens_no_sample_holds(store, tmp_path):
    """The user has to pick one: the line offers the special tokens the stored samples never use (the
    chat template's, which every sample holds, are not offered)."""
    with pytest.raises(StoreUnusable) as refused:
        resolve_mask_token(edited_copy(store, tmp_path, mask_token=False), None)
    line = str(refused.value)
    assert "\n" not in line
    assert line.endswith(
        "pass --mask-token-id with a special token no stored sample holds, e.g. 0 (<|endoftext|>), 3 (<|pad|>), 4 (<|mask|>)"
    )


def test_the_stored_ids_read_in_chunks_give_the_same_offer(store):
    from transformers import AutoTokenizer

    from dflash_pipeline.train.setup import special_ids_no_sample_holds

    features = FeatureStore(store)
    tok = AutoTokenizer.from_pretrained(str(StoreLayout(store).tokenizer_dir))
    assert (
        special_ids_no_sample_holds(features, tok, chunk=7) == special_ids_no_sample_holds(features, tok) == [0, 3, 4]
    )
