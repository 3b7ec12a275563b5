"""Layer types, sliding windows and causal attention, as the reference (z-lab `dflash` 0.1.0) reads them.

The reference's `Qwen3DFlashAttention` makes layer i sliding when `layer_types[i]` is
"sliding_attention" (window `sliding_window`, which `Qwen3Config` keeps only with `use_sliding_window`),
and causal when `is_causal` is true, or, with no `is_causal`, when the layer slides. Our config must read
every such file as it does, write ours where it reads them, and our drafter (DFlash and DFlash-2) must
compute what it computes with them: in training (packed blocks, one mask per kind of layer, dense and
flex) and at inference (cached steps). A tiny random drafter in float32 on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_dflash2 import B, H, dflash2_config, randomized

from dflash_pipeline.shared.model.config import DFlashConfig, LayerAttention
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache
from dflash_pipeline.train.step import attention_masks

ref = pytest.importorskip(
    "dflash.model", reason="the DFlash reference package (`dflash`, in the test extra) is not installed"
)
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

NO_DFLASH2 = dict(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
SLIDING_FULL = ["sliding_attention", "full_attention"]
# (layer_types, sliding_window, is_causal) of our config: windows of 3 cut into blocks of 4 and their context
VARIANTS = {
    "sliding-full-causal": (SLIDING_FULL, 3, True),
    "sliding-full-bidirectional": (SLIDING_FULL, 3, False),
    "sliding-full-reference-rule": (SLIDING_FULL, 3, None),  # the sliding layer causal, the full one not
    "full-sliding-reference-rule": (SLIDING_FULL[::-1], 2, None),
    "full-causal": (None, None, True),
}


def config(arch: str, variant: str) -> DFlashConfig:
    layer_types, window, causal = VARIANTS[variant]
    extra = {} if arch == "dflash2" else NO_DFLASH2
    return dflash2_config(layer_types=layer_types, sliding_window=window, is_causal=causal, **extra)


def reference_class(arch: str):
    return ref.DFlash2DraftModel if arch == "dflash2" else ref.DFlashDraftModel


def reference_layers(model) -> list[LayerAttention]:
    return [LayerAttention(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in model.layers]


def read_by_reference(d: dict) -> list[LayerAttention]:
    """Each layer's attention in the reference model built from config.json `d`."""
    from transformers import Qwen3Config

    arch = "dflash2" if d["architectures"] == ["DFlash2DraftModel"] else "dflash"
    return reference_layers(reference_class(arch)(Qwen3Config(**d)))


def edit(d: dict, **changes) -> dict:
    """`d` with keys changed, and removed where the change is `...`."""
    return {k: v for k, v in {**d, **changes}.items() if v is not ...}


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_config_files_are_read_as_the_reference_reads_them(arch):
    """Our written configs, and files with the keys absent or contradicting each other, give every layer
    the causality and window the reference gives it; ours round-trip unchanged."""
    for variant in VARIANTS:
        ours = config(arch, variant)
        d = ours.to_hf_dict()
        assert DFlashConfig.from_hf_dict(d) == ours
        assert read_by_reference(d) == ours.layer_attention, variant
    base = config(arch, "sliding-full-bidirectional").to_hf_dict()
    files = {
        "no is_causal": edit(base, is_causal=...),
        "no layer_types, max_window_layers 1": edit(base, layer_types=..., max_window_layers=1),
        "no layer_types, no max_window_layers": edit(base, layer_types=..., max_window_layers=...),
        "use_sliding_window false": edit(base, use_sliding_window=False, is_causal=...),
        "no use_sliding_window": edit(base, use_sliding_window=...),
        "use_sliding_window, no sliding_window": edit(base, sliding_window=..., layer_types=["sliding_attention"] * 2),
    }
    for name, d in files.items():
        assert DFlashConfig.from_hf_dict(d).layer_attention == read_by_reference(d), name
    # e.g. the sliding layer without is_causal is causal, and Qwen3Config's window is 4096 when none is given
    assert DFlashConfig.from_hf_dict(files["no is_causal"]).layer_attention[0] == LayerAttention(True, 3)
    default_window = DFlashConfig.from_hf_dict(files["use_sliding_window, no sliding_window"])
    assert default_window.layer_attention == [LayerAttention(False, 4096)] * 2


def test_config_refuses_layer_types_it_cannot_read():
    for bad, message in [
        (dict(layer_types=["full_attention"]), "for each of the 2 layers"),
        (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types must name one of"),
        (dict(is_causal="yes"), "is_causal must be true, false or absent"),
        (dict(sliding_window=0), "sliding_window must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            dflash2_config(**bad)


def random_drafter(arch: str, variant: str, tmp_path):
    """Our random drafter, and the reference's model loaded from the folder it saved itself to."""
    torch.manual_seed(0)
    ours = randomized(DFlashDrafter(config(arch, variant), attention_backend="sdpa_dense"))
    folder = ours.save_pretrained(tmp_path / "drafter")
    theirs, info = reference_class(arch).from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert reference_layers(theirs) == ours.config.layer_attention
    assert json.loads((folder / "config.json").read_text())["is_causal"] == VARIANTS[variant][2]
    return ours, theirs.eval()


def one_doc_batch(anchors: list[int], context: int) -> dict[str, torch.Tensor]:
    """The mask inputs of one pack: a single document of `context` tokens, one block per anchor."""
    n = len(anchors)
    return {
        "anchor_pos": torch.tensor([anchors]),
        "block_doc": torch.zeros(1, n, dtype=torch.long),
        "block_valid": torch.ones(1, n, dtype=torch.bool),
        "context_doc": torch.zeros(1, context, dtype=torch.long),
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_reference_computes_our_outputs_packed_and_cached(arch, variant, tmp_path):
    """Three blocks packed into one training row, with the training masks (one per kind of layer, dense
    and flex), give block by block the reference's output for that block alone; our cached inference
    steps give its cached forward's."""
    ours, theirs = random_drafter(arch, variant, tmp_path)
    g = torch.Generator().manual_seed(1)
    context, embeds = torch.randn(1, 14, 2 * H, generator=g), torch.randn(1, 3 * B, H, generator=g)
    anchors = [3, 9, 14]
    ctx_pos = torch.arange(14)[None]
    block_pos = torch.cat([torch.arange(a, a + B) for a in anchors])[None]
    batch = one_doc_batch(anchors, 14)
    with torch.no_grad():
        for backend in ("sdpa_dense", "flex_eager"):
            ours.attention_backend = backend
            packed = ours(context, embeds, ctx_pos, block_pos, attention_masks(batch, ours.config, backend))
            for n, a in enumerate(anchors):
                rows = slice(n * B, (n + 1) * B)
                alone = theirs(
                    target_hidden=context[:, :a],
                    noise_embedding=embeds[:, rows],
                    position_ids=torch.cat([ctx_pos[:, :a], block_pos[:, rows]], dim=1),
                )
                torch.testing.assert_close(packed[:, rows], alone, rtol=0, atol=5e-5)  # rounding of O(1) values
        my_cache, their_cache = DrafterCache(), ref._make_cache(theirs.config)
        fed = 0
        for n, a in enumerate(anchors):
            rows = slice(n * B, (n + 1) * B)
            cached = theirs(
                target_hidden=context[:, fed:a],
                noise_embedding=embeds[:, rows],
                past_key_values=their_cache,
                position_ids=torch.cat([ctx_pos[:, fed:a], block_pos[:, rows]], dim=1),
                use_cache=True,
            )
            ref._crop_to(their_cache, a)
            step = ours.forward_step(
                context[:, fed:a], ctx_pos[:, fed:a], embeds[:, rows], block_pos[:, rows], my_cache
            )
            torch.testing.assert_close(step, cached, rtol=0, atol=1e-5)  # masked SDPA: GQA expanded or not
            fed = a


def test_each_kind_of_layer_gets_its_own_mask():
    """The training masks differ by kind (so a layer given another kind's mask would compute otherwise),
    and a forward missing a kind's mask is refused."""
    model = DFlashDrafter(config("dflash", "sliding-full-reference-rule"), attention_backend="sdpa_dense")
    masks = attention_masks(one_doc_batch([3, 9], 10), model.config, "sdpa_dense")
    assert list(masks) == [LayerAttention(True, 3), LayerAttention(False, None)]
    assert not torch.equal(*masks.values())
    with pytest.raises(ValueError, match="no attention mask for layers of kind"):
        model(
            torch.zeros(1, 10, 2 * H),
            torch.zeros(1, 2 * B, H),
            torch.arange(10)[None],
            torch.zeros(1, 2 * B, dtype=torch.long),
            {LayerAttention(True, 3): masks[LayerAttention(True, 3)]},
        )


def test_dflash2_generate_with_causal_and_windowed_layers_drafts_what_the_reference_does(
    tiny_target_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    """Greedy speculative decoding of the tiny target with a DFlash-2 drafter whose sliding layer (window
    5) is causal and whose full layer is not (no is_causal: the reference's rule): block by block our loop
    drafts the reference's path, and the tokens and acceptance lengths are the reference's."""
    import time

    from test_speculative import prompts

    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.shared.generation.speculative import dflash_generate
    from dflash_pipeline.shared.model.config import default_target_layer_ids
    from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target

    target = load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)
    cfg = DFlashConfig.for_target(
        target.config,
        default_target_layer_ids(target.config.num_hidden_layers),
        num_layers=2,
        block_size=8,
        mask_token_id=target.config.vocab_size - 1,
        conv_kernel_size=3,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=6,
        layer_types=SLIDING_FULL,
        sliding_window=5,
        is_causal=None,
    )
    torch.manual_seed(0)
    ours = randomized(DFlashDrafter(cfg, attention_backend="sdpa_dense"))
    theirs = ref.DFlash2DraftModel.from_pretrained(ours.save_pretrained(tmp_path / "d"), dtype=torch.float32).eval()
    assert reference_layers(theirs) == [LayerAttention(True, 5), LayerAttention(False, None)]
    paths = {"ours": [], "ref": []}
    for side, model in (("ours", ours), ("ref", theirs)):
        real = model.propose

        def propose(*args, _real=real, _side=side, **kwargs):
            out = _real(*args, **kwargs)
            paths[_side].append(out[0][0].tolist())
            return out

        monkeypatch.setattr(model, "propose", propose)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    stop = stop_token_ids(tiny_tokenizer)
    capture = HiddenStateCapture(target, cfg.target_layer_ids)
    try:
        for p, n_new in zip(prompts(tiny_tokenizer, 2), (30, 24)):
            mine = dflash_generate(target, ours, capture, p, n_new, stop)
            reference = ref.dflash_generate(theirs, target, p[None], n_new, sorted(stop), return_stats=True)
            assert mine.tokens == reference.output_ids[0, len(p) :].tolist()
            assert mine.accepted == reference.acceptance_lengths
    finally:
        capture.close()
    assert len(paths["ours"]) > 3 and paths["ours"] == paths["ref"]
