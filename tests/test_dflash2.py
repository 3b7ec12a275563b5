"""DFlash-2 drafters made by this pipeline are the reference's `DFlash2DraftModel` (z-lab `dflash` 0.1.0).

The reference must load a DFlash-2 drafter saved by `save_pretrained` with every weight, and compute
the same block hidden states (fresh and cached) and the same selector drafts; our convolutions on
packed training blocks equal its convolution block by block; a new drafter's convolutions are the
identity. A tiny random drafter in float32 on the CPU, its weights drawn away from the identity.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_pipeline.shared.model.config import DFlashConfig
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache

ref = pytest.importorskip(
    "dflash.model", reason="the DFlash reference package (`dflash`, in the test extra) is not installed"
)

H, B, K = 32, 4, 3  # hidden size, block size, conv taps
SAME = dict(rtol=0, atol=1e-6)  # the same ops in the same order: a few ulp of O(1) values at most
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def dflash2_config(**kw) -> DFlashConfig:
    values = dict(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        num_target_layers=6,
        mask_token_id=49,
        target_layer_ids=[1, 3],
        num_hidden_layers=2,
        block_size=B,
        rope_theta=10_000.0,
        conv_kernel_size=K,
        conv_group_size=8,
        selector_rank=6,
        selector_top_k=5,
    )
    values.update(kw)
    return DFlashConfig(**values)


def random_drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return randomized(DFlashDrafter(dflash2_config(), attention_backend="sdpa_dense"))


def randomized(model: DFlashDrafter) -> DFlashDrafter:
    """Every weight random and visible in the output: convolutions far from the identity, norms away from 1."""
    model.reset_parameters(std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "_conv." in name:
                p.normal_(0, 0.5)
            elif "codebook" in name:
                p.normal_(0, 1.0)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = random_drafter()
    return model, model.save_pretrained(tmp_path_factory.mktemp("dflash2"))


@pytest.fixture(scope="module")
def reference(saved):
    model, info = ref.DFlash2DraftModel.from_pretrained(saved[1], dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def reference_name(ours: str) -> str:
    """The reference's module names its codebooks `….weight` (its `from_pretrained` maps the file's names)."""
    return ours + ".weight" if ours.endswith("_codebook") else ours


def inputs(seed: int, context: int, blocks: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, context, 2 * H, generator=g), torch.randn(1, blocks * B, H, generator=g)


def test_reference_loads_our_dflash2_drafter_with_every_weight_and_setting(saved, reference):
    ours, folder = saved
    model, info = reference
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    theirs = model.state_dict()
    assert sorted(theirs) == sorted(reference_name(k) for k in ours.state_dict())
    for name, value in ours.state_dict().items():
        assert torch.equal(theirs[reference_name(name)], value), name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size")} == {
        "conv_kernel_size": K,
        "conv_group_size": 8,
    }
    assert (model.candidate_selector.top_k, model.layers[1].mlp_conv.kernel_size) == (5, K)
    assert not any(layer.self_attn.is_causal or layer.self_attn.sliding_window for layer in model.layers)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the released files' names
        assert {"candidate_selector.predecessor_codebook", "layers.0.attention_conv.base_kernel"} <= set(f.keys())
    loaded = DFlashDrafter.from_pretrained(folder, attention_backend="sdpa_dense")
    assert loaded.config == ours.config
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in ours.state_dict().items())


def test_reference_computes_our_block_hidden_states_fresh_and_cached(saved, reference):
    """Two blocks drafted after 9 then 14 context tokens: our training forward equals the reference's
    fresh forward, our cached step its cached forward."""
    ours, _ = saved
    model, _ = reference
    context, _ = inputs(1, 14)
    my_cache, their_cache = DrafterCache(), ref._make_cache(model.config)
    fed = 0
    for step, c in enumerate((9, 14)):
        emb = inputs(10 + step, 0)[1]
        ctx_pos, block_pos = torch.arange(c)[None], torch.arange(c, c + B)[None]
        with torch.no_grad():
            fresh = model(
                target_hidden=context[:, :c], noise_embedding=emb, position_ids=torch.cat([ctx_pos, block_pos], 1)
            )
            cached = model(
                target_hidden=context[:, fed:c],
                noise_embedding=emb,
                past_key_values=their_cache,
                position_ids=torch.cat([ctx_pos[:, fed:], block_pos], dim=1),
                use_cache=True,
            )
            ref._crop_to(their_cache, c)
            train = ours(context[:, :c], emb, ctx_pos, block_pos, torch.ones(1, 1, B, c + B, dtype=torch.bool))
            step_out = ours.forward_step(context[:, fed:c], ctx_pos[:, fed:], emb, block_pos, my_cache)
        torch.testing.assert_close(train, fresh, **SAME)
        torch.testing.assert_close(step_out, cached, **SAME)
        fed = c


def test_packed_blocks_equal_the_reference_block_by_block(saved, reference):
    """Three blocks packed into one training row (each sees the context before its anchor and itself)
    give, block by block, the reference's output for that block alone: the convolutions never cross
    blocks. The convolutions alone too, on the packed rows."""
    ours, _ = saved
    model, _ = reference
    context, embeds = inputs(2, 12, blocks=3)
    anchors = [3, 7, 12]
    ctx_pos = torch.arange(12)[None]
    block_pos = torch.cat([torch.arange(a, a + B) for a in anchors])[None]
    mask = torch.zeros(1, 1, 3 * B, 12 + 3 * B, dtype=torch.bool)
    for n, a in enumerate(anchors):
        mask[0, 0, n * B : (n + 1) * B, :a] = True
        mask[0, 0, n * B : (n + 1) * B, 12 + n * B : 12 + (n + 1) * B] = True
    with torch.no_grad():
        packed = ours(context, embeds, ctx_pos, block_pos, mask)
        x = torch.randn(2, 3 * B, H)
        mine_conv = ours.layers[0].attention_conv
        my_prepared, my_kernel = mine_conv.prepare(x, B)
        my_finished = mine_conv.finish(x.flip(1), my_kernel, B)
        for n, a in enumerate(anchors):
            rows = slice(n * B, (n + 1) * B)
            alone = model(
                target_hidden=context[:, :a],
                noise_embedding=embeds[:, rows],
                position_ids=torch.cat([ctx_pos[:, :a], block_pos[:, rows]], dim=1),
            )
            torch.testing.assert_close(packed[:, rows], alone, rtol=0, atol=1e-5)  # masked SDPA rounds differently
            their_prepared, their_kernel = model.layers[0].attention_conv.prepare(x[:, rows])
            torch.testing.assert_close(my_prepared[:, rows], their_prepared, **SAME)
            their_finished = model.layers[0].attention_conv.finish(x.flip(1)[:, rows], their_kernel)
            torch.testing.assert_close(my_finished[:, rows], their_finished, **SAME)


def test_selector_proposes_what_the_reference_does(saved, reference):
    """Greedy: the same drafted tokens and candidates; sampling from the same seed: the same tokens
    and candidate probabilities."""
    ours, _ = saved
    model, _ = reference
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, B - 1, H, generator=g)
    anchors = torch.randint(0, 50, (4,), generator=g)
    head = torch.nn.Linear(H, 50, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=g)
    with torch.no_grad():
        mine = ours.propose(hidden, anchors, head.weight, 0.0)
        theirs = model.propose(hidden, anchors, head, 0.0)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
        assert mine[2] is None and theirs[2] is None
        plain = ours.compute_logits(hidden, head.weight).argmax(-1)
        assert not torch.equal(mine[0], plain)  # the transition scores change the draft
        torch.manual_seed(5)
        mine = ours.propose(hidden, anchors, head.weight, 0.7)
        torch.manual_seed(5)
        theirs = model.propose(hidden, anchors, head, 0.7)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    torch.testing.assert_close(mine[2], theirs[2], **SAME)


def test_new_dflash2_drafter_computes_what_the_same_dflash_drafter_does():
    """Fresh convolutions are the identity: a new DFlash-2 drafter and a DFlash drafter holding its
    other weights give the same block hidden states, bit for bit, on packed blocks."""
    torch.manual_seed(0)
    dflash2 = DFlashDrafter(dflash2_config(), attention_backend="sdpa_dense").eval()
    plain_config = dflash2_config(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
    dflash = DFlashDrafter(plain_config, attention_backend="sdpa_dense").eval()
    state = {k: v for k, v in dflash2.state_dict().items() if "_conv." not in k and "candidate_selector" not in k}
    dflash.load_state_dict(state)
    context, embeds = inputs(4, 10, blocks=2)
    mask = torch.ones(1, 1, 2 * B, 10 + 2 * B, dtype=torch.bool)
    positions = torch.arange(10, 10 + 2 * B)[None]
    with torch.no_grad():
        out = dflash2(context, embeds, torch.arange(10)[None], positions, mask)
        assert torch.equal(out, dflash(context, embeds, torch.arange(10)[None], positions, mask))


def test_dflash2_config_round_trips_and_dflash_configs_are_unchanged():
    c = dflash2_config()
    d = c.to_hf_dict()
    assert d["architectures"] == ["DFlash2DraftModel"]
    assert {k: d["dflash_config"][k] for k in ("selector_rank", "selector_top_k")} == {
        "selector_rank": 6,
        "selector_top_k": 5,
    }
    assert DFlashConfig.from_hf_dict(d) == c and c.arch == "dflash2"
    plain = dflash2_config(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
    assert plain.arch == "dflash" and plain.to_hf_dict()["architectures"] == ["DFlashDraftModel"]
    assert not {"conv_kernel_size", "selector_rank"} & (set(plain.to_hf_dict()["dflash_config"]) | set(plain.extra))
    with pytest.raises(ValueError, match="needs all of"):
        dflash2_config(selector_rank=None)
    with pytest.raises(ValueError, match="conv_group_size"):
        dflash2_config(conv_group_size=5)
