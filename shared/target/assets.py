"""The target pieces a store carries besides hidden states: tokenizer, config, frozen head weights.

They go to `ROOT/target/` once (written to a temporary folder, fsynced, then renamed), so stage two
and the evaluator never need the target checkpoint to build and train the drafter.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from dflash_pipeline.shared.model.target_head import TargetHead
from dflash_pipeline.shared.runtime.durable import filling_folder, replace_dir_durably
from dflash_pipeline.shared.runtime.errors import first_line
from dflash_pipeline.shared.store.errors import RESUME_HINT
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.target.loading import TargetError, gguf_file_of, require_target_folder, text_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(target: str | Path) -> PreTrainedTokenizerBase:
    """The target's fast tokenizer; a folder without tokenizer files is refused (transformers would
    otherwise build an empty tokenizer from the config alone)."""
    require_target_folder(target)
    gguf = gguf_file_of(target)
    if not gguf and not any((Path(target) / f).exists() for f in TOKENIZER_FILES):
        raise TargetError(
            f"{target}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "copy them from the model's repository into this folder"
        )
    try:
        tok = (
            AutoTokenizer.from_pretrained(str(target), gguf_file=gguf)
            if gguf
            else AutoTokenizer.from_pretrained(str(target))
        )
    except (OSError, ValueError) as exc:
        raise TargetError(f"{target}: cannot load the tokenizer ({first_line(exc)})") from exc
    if not getattr(tok, "is_fast", False):
        raise TargetError(f"{target}: a fast tokenizer is required (loss masks use offset mappings)")
    return tok


def target_assets_ready(root: Path) -> bool:
    return StoreLayout(root).target_head.exists()


def export_target_assets(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, target_config: PretrainedConfig, root: Path
) -> Path:
    """Save embedding, LM head and final norm (safetensors), the full target config and tokenizer.

    `model` may be the truncated target: its embedding, head and norm are the real ones.
    """
    final = StoreLayout(root).target_dir
    what = "the target's embedding, head and tokenizer"
    with filling_folder(
        final.with_name(f"{final.name}.tmp-{os.getpid()}"), what, f"free space there, then {RESUME_HINT}"
    ) as tmp:
        tmp.mkdir(parents=True)
        save_target_head(model, target_config, tmp / StoreLayout.HEAD)
        target_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp / StoreLayout.TOKENIZER)
        replace_dir_durably(tmp, final)
    return final


def save_target_head(
    model: nn.Module, target_config: PretrainedConfig, file: Path, dtype: torch.dtype | None = None
) -> Path:
    """The target's embedding, LM head and final norm as `TargetHead` stores them (in `dtype` if given)."""
    config = text_config(target_config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    lm_head = None if head is None or head.weight is embed else head.weight
    norm = model.model.norm
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    return TargetHead.save(
        file,
        embed_tokens=cast(embed),
        lm_head=None if lm_head is None else cast(lm_head),
        norm=cast(norm.weight),
        norm_eps=float(getattr(norm, "variance_epsilon", getattr(config, "rms_norm_eps", 1e-6))),
    )
