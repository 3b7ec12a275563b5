"""The tiny target loads like a hub model, is deterministic, and has the tokens DFlash needs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_pipeline.data.tiny_target import MASK_TOKEN, build_tiny_target


def test_qwen3_target_loads_through_auto_classes(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (4, 64, 16)
    assert config.vocab_size == len(tok) == 768 and not config.tie_word_embeddings
    assert tok.is_fast and tok.eos_token == "<|im_end|>" and config.eos_token_id == tok.eos_token_id
    assert tok.pad_token == "<|pad|>" and config.pad_token_id == tok.pad_token_id
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", MASK_TOKEN):
        assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(special)) == special
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], 768)


def test_llama_target_loads(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.head_dim == 16


def test_same_seed_same_files_other_seed_other_weights(tiny_target_dir, tmp_path):
    again = build_tiny_target(tmp_path / "again", arch="qwen3", seed=0)
    for file in sorted(tiny_target_dir.iterdir()):
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name
    other = AutoModelForCausalLM.from_pretrained(build_tiny_target(tmp_path / "other", seed=1))
    base = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert not torch.equal(other.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == (tiny_target_dir / "tokenizer.json").read_bytes()
