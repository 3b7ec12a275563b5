"""The drafter: flex == dense (forward and all gradients), no leakage, cache == full, files."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, Qwen3Config

from dflash_pipeline.shared.model import attention as A
from dflash_pipeline.shared.model.blocks import build_blocks, sample_anchors
from dflash_pipeline.shared.model.config import DFlashConfig, default_target_layer_ids
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache
from dflash_pipeline.shared.model.loss import compute_logits
from dflash_pipeline.shared.model.target_head import TargetHead

H, LAYERS = 32, 2  # hidden size, target layers feeding the drafter


def tiny_config(**kw) -> DFlashConfig:
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
        block_size=4,
        rope_theta=10_000.0,
    )
    values.update(kw)
    return DFlashConfig(**values)


def tiny_drafter(seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_config(**kw), attention_backend="sdpa_dense")
    with torch.no_grad():  # norms away from 1 so that their gradients matter too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def make_pack(seed, S=36, N=6, B=4):
    """Three documents and padding; one sampled anchor per document plus anchors at doc 1's first
    token and doc 2's last token (no labels: the next token is padding); the last block is padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (S,), generator=g)
    doc = torch.full((S,), -1)
    pos = torch.zeros(S, dtype=torch.long)
    mask = torch.zeros(S, dtype=torch.bool)
    anchors, start = [torch.tensor([14, 32])], 0
    for d, n in enumerate([14, 9, 10]):
        sl = slice(start, start + n)
        doc[sl], pos[sl] = d, torch.arange(n)
        mask[start + 2 : start + n] = True
        anchors.append(sample_anchors(mask[sl], 1, g) + start)
        start += n
    blocks = build_blocks(ids, doc, pos, mask, torch.cat(anchors).sort().values, N, B, 49)
    ctx = torch.randn(S, LAYERS * H, generator=g)
    emb = torch.randn(N * B, H, generator=g)
    return {"ctx": ctx, "doc": doc, "pos": pos, "emb": emb, **blocks}


def batch_of(packs):
    return {k: torch.stack([p[k] for p in packs]) for k in packs[0]}


def masks(batch, B, window=None):
    args = (batch["anchor_pos"], batch["block_doc"], batch["block_valid"], batch["doc"])
    block_mask = A.build_block_mask(*args, block_size=B, window=window, device="cpu", compile=False)
    return block_mask, A.dense_mask(*args, block_size=B, window=window)


def run(model, batch, mask, backend):
    model.attention_backend = backend
    return model(batch["ctx"], batch["emb"], batch["pos"], batch["block_positions"], mask)


@pytest.mark.parametrize("window", [None, 6])
def test_flex_eager_equals_dense_forward_and_all_gradients(window):
    model = tiny_drafter(sliding_window=window)
    batch = batch_of([make_pack(0), make_pack(1)])
    block_mask, dense = masks(batch, 4, window)
    probe = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(7))
    results = []
    for backend, mask in (("flex_eager", block_mask), ("sdpa_dense", dense)):
        model.zero_grad()
        inputs = {k: v.clone().requires_grad_(True) if k in ("ctx", "emb") else v for k, v in batch.items()}
        out = run(model, inputs, mask, backend)
        (out * probe).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out.detach(), inputs["ctx"].grad, inputs["emb"].grad, grads))
    (o1, c1, e1, g1), (o2, c2, e2, g2) = results
    assert torch.isfinite(o1).all()
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c1, c2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e1, e2, rtol=1e-5, atol=1e-5)
    assert set(g1) == {n for n, _ in model.named_parameters()}
    for name in g1:
        assert g1[name].abs().sum() > 0, name
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["flex_eager", "sdpa_dense"])
def test_no_leakage_perturbations(backend):
    """Bumping one context feature changes exactly the valid blocks of its document whose anchor
    is after it (not the anchor's own position, not later tokens, not other documents); bumping a
    block's input changes only that block. All variants run as one batch against the base pack."""
    model = tiny_drafter()
    pack = make_pack(3)
    variants = [("ctx", j) for j in range(36)] + [("emb", slice(4 * n, 4 * n + 4)) for n in range(6)]
    batch = batch_of([pack] * (len(variants) + 1))
    for i, (key, index) in enumerate(variants, start=1):
        batch[key][i, index] += 3.0
    block_mask, dense = masks(batch, 4)
    with torch.no_grad():
        out = run(model, batch, block_mask if backend == "flex_eager" else dense, backend)
    diff = (out[1:] - out[:1]).abs().amax(-1).view(len(variants), 6, 4).amax(-1)
    assert diff[diff > 1e-6].min() > 1e-3  # "changed" and "unchanged" are far apart
    touched = (diff > 1e-6).tolist()
    for i, (key, index) in enumerate(variants):
        if key == "ctx":
            expected = pack["block_valid"] & (pack["block_doc"] == pack["doc"][index]) & (pack["anchor_pos"] > index)
            assert touched[i] == expected.tolist(), f"context position {index}"
        else:
            assert touched[i] == [m == index.start // 4 for m in range(6)], f"block {index.start // 4}"
    assert {14, 32} <= set(pack["anchor_pos"].tolist())  # a doc-start and a doc-end anchor


def test_invalid_blocks_are_finite_and_get_no_context():
    model = tiny_drafter()
    base = batch_of([make_pack(2)])
    block_mask, _ = masks(base, 4)
    out = run(model, base, block_mask, "flex_eager")
    assert torch.isfinite(out).all()
    changed = dict(base, ctx=base["ctx"] + 1.0)
    out2 = run(model, changed, block_mask, "flex_eager")
    assert torch.equal(out[0, -4:], out2[0, -4:])  # last block is padding


@pytest.mark.parametrize("window", [None, 5])
def test_cache_incremental_equals_full_forward(window):
    model = tiny_drafter(sliding_window=window)
    g = torch.Generator().manual_seed(0)
    S, B = 12, 4
    cuts = [0, 5, 7, 11]
    ctx = torch.randn(1, S, LAYERS * H, generator=g)
    emb = torch.randn(1, 3 * B, H, generator=g)
    anchors = torch.tensor([cuts[1:]])
    block_positions = (anchors[0][:, None] + torch.arange(B)).flatten()[None]
    one_doc = (
        torch.zeros(1, 3, dtype=torch.long),
        torch.ones(1, 3, dtype=torch.bool),
        torch.zeros(1, S, dtype=torch.long),
    )
    dense = A.dense_mask(anchors, *one_doc, B, window)
    with torch.no_grad():
        full = model(ctx, emb, torch.arange(S)[None], block_positions, dense)
        cache = DrafterCache()
        for i in range(3):
            a, b = cuts[i], cuts[i + 1]
            step = model.forward_step(
                ctx[:, a:b],
                torch.arange(a, b)[None],
                emb[:, i * B : (i + 1) * B],
                block_positions[:, i * B : (i + 1) * B],
                cache,
            )
            torch.testing.assert_close(step, full[:, i * B : (i + 1) * B], rtol=1e-5, atol=1e-5)
            assert cache.length == b and cache.keys[0].shape[2] == b


REFERENCE_LAYER_KEYS = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def test_save_load_round_trip_with_reference_names(tmp_path):
    model = tiny_drafter(sliding_window=8, output_multiplier=0.5, final_logit_softcapping=20.0)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{k}" for i in range(2) for k in REFERENCE_LAYER_KEYS}
    assert keys == expected
    assert shapes["fc.weight"] == (H, LAYERS * H)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (2 * 8, H)
    assert shapes["layers.1.self_attn.q_norm.weight"] == (8,)
    loaded = DFlashDrafter.from_pretrained(tmp_path, attention_backend="sdpa_dense")
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    batch = batch_of([make_pack(4)])
    _, dense = masks(batch, 4, 8)
    with torch.no_grad():
        assert torch.equal(run(model, batch, dense, "sdpa_dense"), run(loaded, batch, dense, "sdpa_dense"))


def test_config_json_has_the_reference_structure(tmp_path):
    tiny_drafter(sliding_window=8, final_logit_softcapping=20.0).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["is_causal"] is False and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["dflash_config"]["mask_token_id"] == 49
    assert cfg["dflash_config"]["block_size"] == 4 and cfg["dflash_config"]["final_logit_softcapping"] == 20.0
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["use_sliding_window"] and cfg["sliding_window"] == 8
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10_000.0}
    # the reference builds a Qwen3Config from this file
    hf = Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert hf.layer_types == ["sliding_attention"] * 2 and hf.sliding_window == 8 and hf.head_dim == 8
    assert hf.dflash_config["target_layer_ids"] == [1, 3]


def test_from_hf_dict_reads_a_released_style_config():
    # values of the reference repo's tests/fixtures/dflash2-config.json
    released = {
        "attention_bias": False,
        "bos_token_id": 200000,
        "is_causal": False,
        "dflash_config": {
            "block_size": 16,
            "final_logit_softcapping": 20.0,
            "mask_token_id": 201818,
            "output_multiplier": 0.19611613513818404,
            "target_layer_ids": [1, 13, 25, 37, 49],
        },
        "head_dim": 128,
        "hidden_size": 6656,
        "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5,
        "max_position_embeddings": 131072,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 52,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "use_sliding_window": True,
        "vocab_size": 202048,
    }
    c = DFlashConfig.from_hf_dict(released)
    assert c.target_layer_ids == [1, 13, 25, 37, 49] and c.block_size == 16 and c.mask_token_id == 201818
    assert c.sliding_window == 2048 and c.final_logit_softcapping == 20.0 and c.rope_theta == 500000.0
    assert c.context_width == 5 * 6656 and c.extra == {"bos_token_id": 200000}
    assert DFlashConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_hf_dict({k: v for k, v in released.items() if k != "dflash_config"})


def test_for_target_copies_the_target_shape():
    qwen = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        max_position_embeddings=2048,
    )
    c = DFlashConfig.for_target(qwen, [1, 2], mask_token_id=299, num_layers=3, block_size=8)
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64,
        96,
        4,
        2,
        16,
    )
    assert (c.vocab_size, c.num_target_layers, c.rms_norm_eps, c.rope_theta) == (300, 4, 1e-5, 5e5)
    assert (c.num_hidden_layers, c.block_size, c.mask_token_id, c.max_position_embeddings) == (3, 8, 299, 2048)
    llama = LlamaConfig(
        vocab_size=100,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        rope_theta=1e5,
    )
    c = DFlashConfig.for_target(llama, [1, 3], mask_token_id=0)
    assert c.head_dim == 8 and c.rope_theta == 1e5 and c.num_hidden_layers == 5
    with pytest.raises(ValueError, match="outside the target"):
        DFlashConfig.for_target(llama, [1, 6], mask_token_id=0)


def test_default_target_layer_ids():
    assert default_target_layer_ids(52) == [1, 13, 25, 37, 49]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 2) == [1, 61]
    assert default_target_layer_ids(24, 1) == [12]
    assert default_target_layer_ids(8) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(7) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(4) == [1, 2]
    assert (
        default_target_layer_ids(3) == [1] and default_target_layer_ids(2) == [1] and default_target_layer_ids(1) == [0]
    )
    for L in range(1, 80):
        ids = default_target_layer_ids(L)
        assert ids == sorted(set(ids)) and all(0 <= i < L for i in ids) and 1 <= len(ids) <= 5


@pytest.mark.parametrize("tied", [True, False])
def test_target_head_save_load(tmp_path, tied):
    embed = torch.randn(50, H)
    head = None if tied else torch.randn(50, H)
    norm = torch.rand(H) + 0.5
    file = TargetHead.save(tmp_path, embed_tokens=embed, lm_head=embed if tied else head, norm=norm, norm_eps=1e-5)
    assert file.name == "target_head.safetensors"
    with safe_open(str(file), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
        assert f.metadata()["tied"] == ("true" if tied else "false")
    for where in (tmp_path, file):
        th = TargetHead.load(where)
        assert th.tied is tied and torch.equal(th.embed_tokens, embed) and th.norm_eps == 1e-5
        assert th.lm_head is th.embed_tokens if tied else torch.equal(th.lm_head, head)
        assert torch.equal(th.norm_weight, norm)
        assert dict(th.named_buffers()) and not list(th.parameters()) and th.state_dict() == {}
    ids = torch.tensor([[3, 7]])
    torch.testing.assert_close(th.embed(ids, scale=2.0), embed[ids] * 2.0)
    with pytest.raises(FileNotFoundError, match="target head"):
        TargetHead.load(tmp_path / "nowhere")


def test_target_head_bytes_do_not_depend_on_metadata_order(tmp_path):
    """safetensors writes metadata in HashMap order; the file (the store's weights fingerprint) must not."""
    embed = torch.randn(50, H)
    keys = [f"k{i}" for i in range(8)]
    files = [
        TargetHead.save(tmp_path / str(n), embed_tokens=embed, metadata={k: "v" for k in order})
        for n, order in enumerate((keys, keys[::-1]))
    ]
    raw = files[0].read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])  # 1/10! by chance with HashMap order
    assert files[0].read_bytes() == files[1].read_bytes()
    assert TargetHead.load(files[1]).tied


def test_compute_logits_multiplier_and_softcap():
    model = tiny_drafter(output_multiplier=0.5, final_logit_softcapping=2.0)
    h, w = torch.randn(3, H), torch.randn(50, H)
    torch.testing.assert_close(model.compute_logits(h, w), torch.tanh(h @ w.T * 0.5 / 2.0) * 2.0)
    torch.testing.assert_close(compute_logits(h, w), h @ w.T)


def test_wrong_mask_type_and_width_are_clear_errors():
    model = tiny_drafter()
    batch = batch_of([make_pack(0)])
    block_mask, dense = masks(batch, 4)
    with pytest.raises(TypeError, match="dense bool mask"):
        run(model, batch, block_mask, "sdpa_dense")
    with pytest.raises(TypeError, match="bool"):
        run(model, batch, dense.float(), "flex_eager")
    torch.testing.assert_close(run(model, batch, dense, "flex_eager"), run(model, batch, block_mask, "flex_eager"))
    with pytest.raises(ValueError, match="attention_backend"):
        model.attention_backend = "flash"
    with pytest.raises(ValueError, match="width"):
        model(batch["ctx"][..., :H], batch["emb"], batch["pos"], batch["block_positions"], dense)


def bucketed_batch():
    """One pack of a bucketed shape (S 128, 8 blocks of 16) for the compiled flex kernel: (batch, block
    mask, dense mask)."""
    S, N, B = 128, 8, 16
    g = torch.Generator().manual_seed(0)
    doc = torch.cat([torch.zeros(70, dtype=torch.long), torch.ones(50, dtype=torch.long), torch.full((8,), -1)])
    pos = torch.cat([torch.arange(70), torch.arange(50), torch.zeros(8, dtype=torch.long)])
    mask = doc >= 0
    anchors = sample_anchors(mask, 6, g, doc=doc)
    blocks = build_blocks(torch.randint(0, 48, (S,), generator=g), doc, pos, mask, anchors, N, B, 49)
    batch = batch_of(
        [
            {
                "ctx": torch.randn(S, LAYERS * H, generator=g),
                "doc": doc,
                "pos": pos,
                "emb": torch.randn(N * B, H, generator=g),
                **blocks,
            }
        ]
    )
    return (batch, *masks(batch, B))


@pytest.mark.slow
def test_compiled_flex_drafter_forward_equals_dense():
    """The drafter's flex_compiled backend (CPU: forward only) on one bucketed shape."""
    model = tiny_drafter(block_size=16)
    batch, block_mask, dense = bucketed_batch()
    with torch.no_grad():
        out = run(model, batch, block_mask, "flex_compiled")
        ref = run(model, batch, dense, "sdpa_dense")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_compiled_drafter_leaves_compiled_flex_to_the_eager_drafter(monkeypatch):
    """`dflash-train --compile-drafter` traces the drafter (and `compiled_flex()` in it) before the
    held-out evaluation runs the same drafter eagerly. dynamo treats the nested torch.compile as a
    no-op, so had the trace created the process's compiled flex it would have cached the bare
    flex_attention: the evaluation would run unfused flex (its "called without torch.compile" warning)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(A, "_compiled_flex", None)  # as in a fresh process: the trace comes first
    torch._dynamo.reset()
    model = tiny_drafter(block_size=16)
    model.attention_backend = "flex_compiled"
    batch, block_mask, dense = bucketed_batch()
    inputs = (batch["ctx"], batch["emb"], batch["pos"], batch["block_positions"], block_mask)
    with torch.no_grad():
        torch.compile(model, dynamic=False, backend="aot_eager")(*inputs)  # the training forward's trace
        with A.CompileCounter() as counter:
            out = run(model, batch, block_mask, "flex_compiled")  # the evaluation's eager forward
        ref = run(model, batch, dense, "sdpa_dense")
    assert A.compiled_flex() is not flex_attention
    assert counter.count == 1  # the eager drafter's flex ran compiled (one graph), not unfused
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
