"""The target pieces a store carries besides hidden states: tokenizer, config, frozen head weights.

They go to `ROOT/target/` once (written to a temporary folder, fsynced, then renamed), so stage two
and the evaluator never need the target checkpoint to build and train the drafter.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from dflash_pipeline.extract.target import gguf_file_of, text_config
from dflash_pipeline.shared.drafter import TargetHead
from dflash_pipeline.shared.durable import replace_dir_durably

TARGET_DIR = "target"
HEAD_FILE = "target_head.safetensors"


def load_tokenizer(target: str | Path) -> PreTrainedTokenizerBase:
    gguf = gguf_file_of(target)
    tok = AutoTokenizer.from_pretrained(str(target), gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(str(target))
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{target}: a fast tokenizer is required (loss masks use offset mappings)")
    return tok


def target_assets_ready(root: Path) -> bool:
    return (root / TARGET_DIR / HEAD_FILE).exists()


def export_target_assets(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, target_config: PretrainedConfig, root: Path
) -> Path:
    """Save embedding, LM head and final norm (safetensors), the full target config and tokenizer.

    `model` may be the truncated target: its embedding, head and norm are the real ones.
    """
    final = root / TARGET_DIR
    tmp = root / f"{TARGET_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = text_config(target_config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    lm_head = None if head is None or head.weight is embed else head.weight
    norm = model.model.norm
    TargetHead.save(
        tmp / HEAD_FILE,
        embed_tokens=embed,
        lm_head=lm_head,
        norm=norm.weight,
        norm_eps=float(getattr(norm, "variance_epsilon", getattr(config, "rms_norm_eps", 1e-6))),
    )
    target_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp / "tokenizer")
    replace_dir_durably(tmp, final)
    return final


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def weights_fingerprint(root: Path) -> str:
    """Identity of the target's weights as far as the drafter sees them (its frozen head)."""
    return file_sha256(root / TARGET_DIR / HEAD_FILE)
