"""The engine's regrouped projections: q/k/v (and gate/up) become row blocks of one weight, the HF
modules keep working on views of it with unchanged values, a second engine on the same model reuses
the buffer, and a target with biased q/k/v projections (Qwen2) still decodes exactly as HF does."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from dflash_pipeline.shared.generation.decoder import GenerationError, fuse_projections
from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine, Request
from dflash_pipeline.shared.generation.sampling import SamplingParams


def linears(bias: bool, sizes=(32, 8, 8), width: int = 16) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(width, n, bias=bias) for n in sizes]


@pytest.mark.parametrize("bias", [False, True])
def test_fused_outputs_equal_the_modules_and_the_modules_are_unchanged(bias):
    modules = linears(bias)
    x = torch.randn(5, 16)
    before = [m(x) for m in modules]
    weights = [m.weight.detach().clone() for m in modules]
    fused = fuse_projections(modules)
    for got, want in zip(fused(x), before):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for m, w, want in zip(modules, weights, before):
        assert torch.equal(m.weight, w)  # same values
        assert torch.equal(m(x), want)  # the HF module still computes what it did
    # the modules' parameters are views of the one buffer: nothing is held twice
    assert modules[1].weight.data_ptr() == fused.weight[32].data_ptr()
    assert modules[2].weight.data_ptr() == fused.weight[40].data_ptr()
    if bias:
        assert modules[2].bias.data_ptr() == fused.bias[40].data_ptr()


def test_a_second_fusion_reuses_the_buffer():
    modules = linears(False)
    first = fuse_projections(modules)
    assert fuse_projections(modules) is first


def test_projections_with_and_without_bias_are_refused():
    modules = linears(False)
    modules[1] = nn.Linear(16, 8, bias=True)
    with pytest.raises(GenerationError, match="with and without a bias"):
        fuse_projections(modules)


def test_biased_qkv_target_decodes_as_hf_generate():
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random biases: the default zeros would hide a missing bias
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(3, 256, (n,), generator=g).tolist(), 12) for n in (5, 17, 9)]
    want = [
        model.generate(
            torch.tensor([list(r.prompt)]),
            max_new_tokens=r.max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(r.prompt)),
        )[0, len(r.prompt) :].tolist()
        for r in requests
    ]
    settings = EngineSettings(max_batch=2, max_request_tokens=64, page_size=4)
    replies = GenerationEngine(model, stop_ids=(), sampling=SamplingParams(), settings=settings).generate(requests)
    assert [r.tokens for r in replies] == want
