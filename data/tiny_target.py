"""A tiny random target LLM of a real architecture, with a real (small) BPE tokenizer and ChatML.

Tests and the CPU demo need a target that loads exactly like a hub model (`AutoModelForCausalLM` /
`AutoTokenizer.from_pretrained` on a folder) without any download. Everything is deterministic:
the tokenizer is trained on the packaged sample corpus, the weights come from a seeded RNG.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from .locations import sample_corpus_path
from .records import iter_records

MASK_TOKEN = "<|mask|>"  # the DFlash drafter's mask token
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", MASK_TOKEN]
VOCAB_SIZE = 768

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

CONFIGS = {"qwen3": Qwen3Config, "llama": LlamaConfig}


def _corpus_texts() -> list[str]:
    texts = []
    for record in iter_records(sample_corpus_path()):
        texts.extend(m["role"] + "\n" + m["content"] for m in record.messages)
    return texts


def build_tiny_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (vocab 768) on the sample corpus, give it ChatML special tokens and
    template, and save it into `out_dir`. eos is ``<|im_end|>`` so generation stops at end of turn."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus_texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        mask_token=MASK_TOKEN,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_target(
    out_dir: str | Path, arch: str = "qwen3", num_layers: int = 4, hidden: int = 64, seed: int = 0
) -> Path:
    """Save a random `arch` ("qwen3" or "llama") causal LM (head_dim 16, GQA 2:1, untied LM head)
    and its tokenizer into `out_dir`; the same arguments give the same files' contents."""
    if arch not in CONFIGS:
        raise ValueError(f"arch must be one of {', '.join(CONFIGS)}, got {arch!r}")
    if hidden % 32:
        raise ValueError(f"hidden must be a multiple of 32 (head_dim 16, 2 heads per kv head), got {hidden}")
    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer(out_dir)
    heads = hidden // 16
    config = CONFIGS[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir
