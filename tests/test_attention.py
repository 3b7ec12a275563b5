"""The DFlash mask rule: hand-written example, flex mask_mod == dense mask, kernels, fallback."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from dflash_pipeline.shared.model import attention as A
from dflash_pipeline.shared.model.blocks import build_blocks

T, F_ = True, False


def hand_pack():
    """Two documents (ids 10..14 and 20..23) + one padding token; anchors 3 and 6; 3 blocks of 4."""
    ids = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22, 23, 0])
    doc = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, -1])
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 0])
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    blocks = build_blocks(ids, doc, pos, mask, torch.tensor([3, 6]), num_blocks=3, block_size=4, mask_token_id=99)
    return doc, blocks


def mask_args(doc, blocks):
    return blocks["anchor_pos"][None], blocks["block_doc"][None], blocks["block_valid"][None], doc[None]


def test_dense_mask_hand_example():
    doc, blocks = hand_pack()
    m = A.dense_mask(*mask_args(doc, blocks), block_size=4)
    assert m.shape == (1, 1, 12, 22)
    m = m[0, 0]
    #                context 0..9                     block 0        block 1        block 2
    ctx0 = [T, T, T, F_, F_, F_, F_, F_, F_, F_]  # anchor 3 in doc 0: keys 0,1,2
    ctx1 = [F_, F_, F_, F_, F_, T, F_, F_, F_, F_]  # anchor 6 in doc 1: key 5 only (doc 0 hidden)
    none = [F_] * 10
    b0 = [T] * 4 + [F_] * 8
    b1 = [F_] * 4 + [T] * 4 + [F_] * 4
    expected = [ctx0 + b0] * 4 + [ctx1 + b1] * 4 + [none + [F_] * 12] * 4  # padding block sees nothing
    assert m.tolist() == expected


def test_dense_mask_hand_example_with_window():
    doc, blocks = hand_pack()
    m = A.dense_mask(*mask_args(doc, blocks), block_size=4, window=2)[0, 0]
    # token k of block 0 (anchor 3) sees context j iff j < 3 and 3 + k - j < 2: only j=2 for k=0
    assert m[0, :10].tolist() == [F_, F_, T, F_, F_, F_, F_, F_, F_, F_]
    assert not m[1:4, :10].any()
    # inside the block |k - k'| < 2
    assert m[0:4, 10:14].tolist() == [[T, T, F_, F_], [T, T, T, F_], [F_, T, T, T], [F_, F_, T, T]]
    assert m[4, :10].tolist() == [F_, F_, F_, F_, F_, T, F_, F_, F_, F_]  # anchor 6: 6 - 5 < 2


def test_dense_mask_hand_example_causal():
    """Causal (the reference's `is_causal` layers): block token k sees its block's tokens up to k; the
    context before the anchor stays visible, and with a window the same window applies."""
    doc, blocks = hand_pack()
    m = A.dense_mask(*mask_args(doc, blocks), block_size=4, causal=True)[0, 0]
    lower = [[T, F_, F_, F_], [T, T, F_, F_], [T, T, T, F_], [T, T, T, T]]
    assert m[0:4, 10:14].tolist() == lower and m[4:8, 14:18].tolist() == lower
    assert torch.equal(m[:8, :10], A.dense_mask(*mask_args(doc, blocks), block_size=4)[0, 0, :8, :10])
    windowed = A.dense_mask(*mask_args(doc, blocks), block_size=4, window=2, causal=True)[0, 0]
    assert windowed[0:4, 10:14].tolist() == [[T, F_, F_, F_], [T, T, F_, F_], [F_, T, T, F_], [F_, F_, T, T]]


def random_layout(seed, batch=2, S=40, N=6, B=4):
    """Random packs: several documents, padding tail, anchors anywhere incl. doc starts, invalid blocks."""
    g = torch.Generator().manual_seed(seed)
    docs, anchors, bdocs, valid = [], [], [], []
    for _ in range(batch):
        cuts = sorted(torch.randperm(S - 6, generator=g)[:3].add(1).tolist())
        doc = torch.full((S,), -1)
        edges = [0, *cuts, S - 3]
        for d in range(len(edges) - 1):
            doc[edges[d] : edges[d + 1]] = d
        n_valid = int(torch.randint(1, N + 1, (1,), generator=g))
        starts = torch.tensor(edges[:-1])
        picks = torch.cat([starts, torch.randint(0, S - 3, (N,), generator=g)])[:n_valid]
        anchor = torch.zeros(N, dtype=torch.long)
        anchor[:n_valid] = picks.sort().values
        bdoc = torch.full((N,), -1)
        bdoc[:n_valid] = doc[anchor[:n_valid]]
        v = torch.zeros(N, dtype=torch.bool)
        v[:n_valid] = True
        docs.append(doc), anchors.append(anchor), bdocs.append(bdoc), valid.append(v)
    return torch.stack(anchors), torch.stack(bdocs), torch.stack(valid), torch.stack(docs)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_mod_equals_dense_mask(seed, window, causal):
    S, N, B = 40, 6, 4
    args = random_layout(seed, S=S, N=N, B=B)
    dense = A.dense_mask(*args, block_size=B, window=window, causal=causal)
    mask_mod = A.dflash_mask_mod(*args, block_size=B, window=window, causal=causal)
    flex = create_mask(mask_mod, 2, 1, N * B, S + N * B, device="cpu")
    assert torch.equal(flex, dense)
    assert not dense[~args[2].repeat_interleave(B, 1)[:, None]].any()  # invalid blocks see nothing


def test_fully_masked_rows_give_zeros_not_nan_in_every_backend():
    S, N, B = 16, 2, 8
    args = (
        torch.tensor([[5, 0]]),
        torch.tensor([[0, -1]]),
        torch.tensor([[True, False]]),
        torch.zeros(1, S, dtype=torch.long),
    )
    dense = A.dense_mask(*args, block_size=B)
    block_mask = A.build_block_mask(*args, block_size=B, device="cpu", compile=False)
    q = torch.randn(1, 4, N * B, 8, requires_grad=True)
    k = torch.randn(1, 2, S + N * B, 8, requires_grad=True)
    v = torch.randn(1, 2, S + N * B, 8, requires_grad=True)
    for fn, mask in ((A.sdpa_dense_attention, dense), (A.flex_attention_eager, block_mask)):
        out = fn(q, k, v, mask, 0.3)
        out.sum().backward()
        assert torch.equal(out[:, :, B:], torch.zeros_like(out[:, :, B:]))
        assert out[:, :, :B].abs().sum() > 0
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert torch.equal(q.grad[:, :, B:], torch.zeros_like(q.grad[:, :, B:]))
        q.grad = k.grad = v.grad = None


def test_flex_eager_equals_sdpa_dense_forward_and_backward():
    S, N, B = 40, 6, 4
    args = random_layout(3, S=S, N=N, B=B)
    dense = A.dense_mask(*args, block_size=B, window=7)
    block_mask = A.build_block_mask(*args, block_size=B, window=7, device="cpu", compile=False)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, h, n, 8, generator=g) for h, n in ((4, N * B), (2, S + N * B), (2, S + N * B))]
    grads = []
    for fn, mask in ((A.flex_attention_eager, block_mask), (A.sdpa_dense_attention, dense)):
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        out = fn(q, k, v, mask, 0.35)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([out.detach(), q.grad, k.grad, v.grad])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_call_steps_down_kernel_options_on_resource_error(monkeypatch):
    class OutOfResources(RuntimeError):
        pass

    calls = []

    def fake(q, k, v, *, block_mask, scale, enable_gqa, kernel_options):
        calls.append(kernel_options)
        if kernel_options is None:
            raise RuntimeError("inductor failed") from OutOfResources(
                "out of resource: shared memory, Required: 147456"
            )
        return q

    monkeypatch.setattr(A, "_compiled_flex", fake)
    A.reset_kernel_options()
    try:
        q = torch.zeros(1, 1, 4, 2)
        assert A.flex_attention_compiled(q, q, q, None, 1.0) is q
        assert calls == [None, A.KERNEL_OPTION_FALLBACKS[1]]
        A.flex_attention_compiled(q, q, q, None, 1.0)  # the working rung stays pinned
        assert calls[-1] == A.KERNEL_OPTION_FALLBACKS[1] and len(calls) == 3
        explicit = {"BLOCK_M": 16}
        A.flex_attention_compiled(q, q, q, None, 1.0, explicit)  # explicit options are never replaced
        assert calls[-1] == explicit

        def broken(*a, **kw):
            raise ValueError("not a resource problem")

        monkeypatch.setattr(A, "_compiled_flex", broken)
        with pytest.raises(ValueError, match="not a resource problem"):
            A.flex_attention_compiled(q, q, q, None, 1.0)
    finally:
        A.reset_kernel_options()


def test_shape_bucket():
    assert [A.shape_bucket(n) for n in (1, 128, 129, 4000)] == [128, 128, 256, 4096]


@pytest.mark.slow
def test_compiled_flex_forward_equals_dense_and_does_not_recompile():
    """Compiled flex (CPU: forward only) == dense SDPA; new anchors/docs per step reuse the graphs."""
    S, N, B = 128, 8, 16
    g = torch.Generator().manual_seed(0)
    errors, counts = [], []
    for step in range(3):
        args = random_layout(10 + step, batch=1, S=S, N=N, B=B)
        q = torch.randn(1, 4, N * B, 16, generator=g)
        k = torch.randn(1, 2, S + N * B, 16, generator=g)
        v = torch.randn(1, 2, S + N * B, 16, generator=g)
        with A.CompileCounter() as counter:
            block_mask = A.build_block_mask(*args, block_size=B, device="cpu", compile=True)
            out = A.flex_attention_compiled(q, k, v, block_mask, 0.25)
        counts.append(counter.count)
        ref = A.sdpa_dense_attention(q, k, v, A.dense_mask(*args, block_size=B), 0.25)
        errors.append((out - ref).abs().max().item())
    assert max(errors) < 1e-4, errors
    assert counts[1:] == [0, 0], counts
