"""Compiled flex_attention on the GPU: forward AND backward == dense SDPA at training shapes.

Run on the GPU machine: `python -m pytest tests/gpu/test_flex_gpu.py -q -s` (prints the errors).
Shapes: a 4096-token pack of several documents, 256 blocks of 16 (Q = 4096, KV = 8192).
Errors are relative: max |a - b| / max |b|.
"""

import pytest
import torch

from dflash_pipeline.shared.model import attention as A
from dflash_pipeline.shared.model.blocks import build_blocks, sample_anchors
from dflash_pipeline.shared.model.config import DFlashConfig
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.train.step import compiled_drafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S, N, B = 4096, 256, 16
DEV = "cuda"


def pack_layout(seed: int) -> dict[str, torch.Tensor]:
    """Documents of random length (prompt 30% unmasked), padding tail, up to N-8 anchors."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((S,), -1)
    pos = torch.zeros(S, dtype=torch.long)
    mask = torch.zeros(S, dtype=torch.bool)
    anchors, start, d = [], 0, 0
    while start < S - 200:
        n = min(int(torch.randint(200, 1500, (1,), generator=g)), S - 100 - start)
        sl = slice(start, start + n)
        doc[sl], pos[sl] = d, torch.arange(n)
        mask[start + int(0.3 * n) : start + n] = True
        anchors.append(sample_anchors(mask[sl], 60, g) + start)
        start, d = start + n, d + 1
    anchors = torch.cat(anchors)
    anchors = anchors[torch.randperm(len(anchors), generator=g)[: N - 8]].sort().values
    ids = torch.randint(0, 1000, (S,), generator=g)
    blocks = build_blocks(ids, doc, pos, mask, anchors, N, B, 999)
    return {"doc": doc, "pos": pos, **blocks}


def mask_args(layout):
    return tuple(layout[k][None].to(DEV) for k in ("anchor_pos", "block_doc", "block_valid", "doc"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def attention_grads(fn, mask, q, k, v, probe):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, mask, q.shape[-1] ** -0.5)
    (out.float() * probe).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_forward_backward_equals_dense(dtype):
    layout = pack_layout(0)
    args = mask_args(layout)
    block_mask = A.build_block_mask(*args, block_size=B, device=DEV)
    dense = A.dense_mask(*args, block_size=B)
    g = torch.Generator(device=DEV).manual_seed(0)
    q32 = torch.randn(1, 32, N * B, 128, device=DEV, generator=g)
    k32 = torch.randn(1, 8, S + N * B, 128, device=DEV, generator=g)
    v32 = torch.randn(1, 8, S + N * B, 128, device=DEV, generator=g)
    probe = torch.randn(1, 32, N * B, 128, device=DEV, generator=g)
    ref = attention_grads(A.sdpa_dense_attention, dense, q32, k32, v32, probe)
    low = [t.to(dtype) for t in (q32, k32, v32)]
    flex = attention_grads(A.flex_attention_compiled, block_mask, *low, probe)
    dense_low = attention_grads(A.sdpa_dense_attention, dense, *low, probe)
    names = ("out", "dq", "dk", "dv")
    flex_err = [rel(a, b) for a, b in zip(flex, ref, strict=True)]
    base_err = [rel(a, b) for a, b in zip(dense_low, ref, strict=True)]
    print(f"\n{dtype}: flex vs fp32 dense {dict(zip(names, flex_err, strict=True))}")
    print(f"{dtype}: dense {dtype} vs fp32 dense {dict(zip(names, base_err, strict=True))}")
    invalid_rows = ~layout["block_valid"].repeat_interleave(B).to(DEV)
    assert (flex[0][0][:, invalid_rows] == 0).all() and torch.isfinite(flex[1]).all()
    for name, fe, be in zip(names, flex_err, base_err, strict=True):
        limit = 1e-4 if dtype == torch.float32 else 3 * be + 2e-3
        assert fe < limit, (name, fe, be)


def drafter_and_batch(seed: int, **config):
    torch.manual_seed(0)
    cfg = DFlashConfig(
        **config,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=1000,
        num_target_layers=36,
        mask_token_id=999,
        target_layer_ids=[1, 17, 33],
        num_hidden_layers=2,
        block_size=B,
    )
    model = DFlashDrafter(cfg).to(DEV)
    layout = pack_layout(seed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    batch = {
        "ctx": torch.randn(1, S, cfg.context_width, device=DEV, generator=g),
        "emb": torch.randn(1, N * B, cfg.hidden_size, device=DEV, generator=g) * 0.05,
        "pos": layout["pos"][None].to(DEV),
        "block_positions": layout["block_positions"][None].to(DEV),
    }
    return model, layout, batch


def drafter_step(model, layout, batch, backend, autocast=False, run=None):
    """Output and gradients of one forward/backward; `run`: what to call instead of `model` (its
    compiled form)."""
    args = mask_args(layout)
    model.attention_backend = backend
    mask = (
        A.dense_mask(*args, block_size=B)
        if backend == "sdpa_dense"
        else A.build_block_mask(*args, block_size=B, device=DEV)
    )
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = (model if run is None else run)(batch["ctx"], batch["emb"], batch["pos"], batch["block_positions"], mask)
    probe = torch.randn(out.shape, device=out.device, generator=torch.Generator(device=out.device).manual_seed(5))
    (out.float() * probe).sum().backward()  # (a norm-invariant loss like mean(out**2) has ~0 gradient)
    # the parameters the output depends on (not DFlash-2's selector, which only the loss reads)
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True])
def test_drafter_compiled_flex_equals_dense_with_gradients(autocast):
    model, layout, batch = drafter_and_batch(1)
    out_ref, g_ref = drafter_step(model, layout, batch, "sdpa_dense", autocast=False)
    out, g = drafter_step(model, layout, batch, "flex_compiled", autocast=autocast)
    errs = {"out": rel(out, out_ref), **{n: rel(g[n], g_ref[n]) for n in g}}
    worst = max(errs, key=errs.get)
    print(f"\nautocast={autocast}: worst relative error {worst} {errs[worst]:.2e}, out {errs['out']:.2e}")
    limit = 5e-2 if autocast else 1e-3
    assert all(e < limit for e in errs.values()), errs


def test_no_recompiles_across_steps_with_new_anchors():
    model, _, batch = drafter_and_batch(2)
    counts = []
    for step in range(4):
        with A.CompileCounter() as counter:
            drafter_step(model, pack_layout(10 + step), batch, "flex_compiled", autocast=True)
        counts.append(counter.count)
    print(f"\ngraphs compiled per step: {counts}")
    assert counts[1:] == [0, 0, 0], counts


DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=64, selector_top_k=8)


@pytest.mark.parametrize("config", [{}, DFLASH2], ids=["dflash", "dflash2"])
def test_drafter_compiled_as_one_graph_equals_eager_and_never_recompiles(config):
    """`dflash-train --compile-drafter`: the whole drafter compiled, compiled flex inside, against the
    eager drafter calling compiled flex; one graph for steps with new anchors and documents."""
    model, layout, batch = drafter_and_batch(4, **config)
    compiled = compiled_drafter(model)
    for autocast, limit in ((False, 1e-3), (True, 5e-2)):
        out_ref, g_ref = drafter_step(model, layout, batch, "flex_compiled", autocast=autocast)
        out, g = drafter_step(model, layout, batch, "flex_compiled", autocast=autocast, run=compiled)
        assert g.keys() == g_ref.keys()
        errs = {"out": rel(out, out_ref), **{n: rel(g[n], g_ref[n]) for n in g}}
        worst = max(errs, key=errs.get)
        print(f"\nautocast={autocast}: worst relative error {worst} {errs[worst]:.2e}, out {errs['out']:.2e}")
        assert all(e < limit for e in errs.values()), errs
    counts = []
    for step in range(3):
        with A.CompileCounter() as counter:
            drafter_step(model, pack_layout(20 + step), batch, "flex_compiled", autocast=True, run=compiled)
        counts.append(counter.count)
    assert counts == [0, 0, 0], counts


def test_calibrate_kernel_options_runs_forward_and_backward():
    layout = pack_layout(3)
    block_mask = A.build_block_mask(*mask_args(layout), block_size=B, device=DEV)
    q = torch.randn(1, 32, N * B, 128, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, S + N * B, 128, device=DEV, dtype=torch.bfloat16)
    options = A.calibrate_kernel_options(q, kv, kv, block_mask, 128**-0.5)
    print(f"\nkernel options in use: {options or 'inductor defaults'}")
    assert options in A.KERNEL_OPTION_FALLBACKS
