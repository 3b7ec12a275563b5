"""The generation engine on the GPU: CUDA-graph decode with the Triton paged attention gives the
same replies as HF `generate` one prompt at a time (float32), and as the engine without graphs
(greedy and sampled), with rows reused across many requests.

Run on the GPU machine: `python -m pytest tests/gpu/test_engine_gpu.py -q -s`.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_pipeline.data.tiny_target import build_tiny_target
from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine, Request
from dflash_pipeline.shared.generation.sampling import SamplingParams, request_key

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def fresh_dynamo_caches():
    """Each test compiles the engine's layer functions afresh. Dynamo keeps one cache per function for
    the whole session, and the engines of earlier tests (each model, cache dtype, one row or more) would
    fill its eight entries, after which it runs the function uncompiled inside the graphs."""
    torch._dynamo.reset()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, tmp_path_factory):
    folder = build_tiny_target(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=4, hidden=128)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().cuda()


def workload(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [
        Request(torch.randint(5, 700, (int(L),), generator=g).tolist(), int(m), key=request_key(0, i))
        for i, (L, m) in enumerate(
            zip(torch.randint(3, 200, (n,), generator=g), torch.randint(1, 60, (n,), generator=g))
        )
    ]


def run(model, requests, sampling, graphs, max_batch=16, bucket_step=64, kv_cache_dtype=None):
    settings = EngineSettings(
        max_batch=max_batch,
        max_request_tokens=320,
        page_size=16,
        cuda_graphs=graphs,
        graph_bucket_step=bucket_step,
        kv_cache_dtype=kv_cache_dtype,
    )
    return [
        r.tokens for r in GenerationEngine(model, stop_ids=[], sampling=sampling, settings=settings).generate(requests)
    ]


def test_graph_decode_equals_hf_generate_and_eager(model):
    requests = workload(40)
    graphed = run(model, requests, SamplingParams(), True)
    assert graphed == run(model, requests, SamplingParams(), False)
    for r, got in zip(requests[:12], graphed):
        ids = torch.tensor([list(r.prompt)], device="cuda")
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.shape[1] :].tolist()
        assert got == want


def test_sampled_graph_decode_is_independent_of_batching(model):
    requests = workload(40)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=64)
    full = run(model, requests, sampling, True)
    assert full == run(model, requests, sampling, True, max_batch=5)
    assert full == run(model, requests, sampling, False, max_batch=7)


def test_fp8_kv_cache_graph_decode_equals_eager(model):
    """The fp8 cache under CUDA graphs (the Triton kernel's fp8 loads) replies as without graphs (the
    same kernel, eager), greedy and sampled, and differs from the lossless cache."""
    requests = workload(40)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)):
        graphed = run(model, requests, sampling, True, kv_cache_dtype="float8_e4m3fn")
        assert graphed == run(model, requests, sampling, False, max_batch=7, kv_cache_dtype="float8_e4m3fn")
    assert graphed != run(model, requests, sampling, True)


def test_fp8_kv_cache_graph_decode_equals_the_cpu_engine(model):
    """The fp8 cache as the GPU reads it (values token-minor, value pages loaded unmasked, CUDA graphs)
    gives the greedy replies of the same cache on the CPU (row by row, only each row's tokens read;
    equal to HF attending to fp8-rounded keys and values: tests/test_generation_engine.py), with pages
    reused across requests, so stale tails are read."""
    requests = workload(40)
    gpu = run(model, requests, SamplingParams(), True, max_batch=8, kv_cache_dtype="float8_e4m3fn")
    cpu_model = copy.deepcopy(model).cpu()
    assert gpu[:12] == run(
        cpu_model, requests[:12], SamplingParams(), False, max_batch=8, kv_cache_dtype="float8_e4m3fn"
    )


@pytest.mark.parametrize("continued", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_varlen_prefill_attention_equals_per_prompt_sdpa(groups, continued):
    """bf16 on CUDA: the packed prompts go through flash attention's variable-length kernel in one
    call; it must equal causal SDPA run prompt by prompt (the CPU / float32 path), also for prompts
    continued from cached tokens (fewer queries than keys, the causal mask aligned at the end)."""
    from dflash_pipeline.shared.generation.decoder import Packing, packed_causal_attention, uses_varlen

    g = torch.Generator().manual_seed(0)
    key_lengths = [1, 37, 300, 5, 128]
    query_lengths = [1, 9, 300, 1, 64] if continued else key_lengths
    heads, d = 8, 128
    q = torch.randn(sum(query_lengths), heads, d, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(sum(key_lengths), heads // groups, d, generator=g).to("cuda", torch.bfloat16) for _ in "kv")
    assert uses_varlen(q)
    packing = Packing.of(query_lengths, key_lengths, q)
    assert packing.cu_query is not None
    looped_packing = Packing(packing.query_bounds, packing.key_bounds, None, None)
    packed = packed_causal_attention(q, k, v, packing, groups, d**-0.5)
    looped = packed_causal_attention(q, k, v, looped_packing, groups, d**-0.5)
    assert packed.shape == looped.shape == q.shape
    torch.testing.assert_close(packed.float(), looped.float(), atol=2e-2, rtol=2e-2)
    # a prompt's rows do not see another prompt: changing prompt 2's keys moves only its rows
    qb, kb = packing.query_bounds, packing.key_bounds
    k2 = k.clone()
    k2[kb[2] : kb[3]] += 1
    moved = (packed_causal_attention(q, k2, v, packing, groups, d**-0.5) != packed).any(-1).any(-1)
    assert moved[qb[2] : qb[3]].any() and not moved[: qb[2]].any() and not moved[qb[3] :].any()
    # and a query does not see keys after its own position: the last key of prompt 4 moves only its last query
    k3 = k.clone()
    k3[kb[5] - 1] += 1
    moved = (packed_causal_attention(q, k3, v, packing, groups, d**-0.5) != packed).any(-1).any(-1)
    assert moved[qb[5] - 1] and not moved[: qb[5] - 1].any()


def test_graphs_of_every_bucket_size_decode_like_eager(model):
    """Buckets every 8 rows (8, 16, ..., 48): as requests finish, the running rows move down through
    many bucket sizes, each its own captured graph; greedy and sampled replies equal eager decoding."""
    requests = workload(48)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)):
        graphed = run(model, requests, sampling, True, max_batch=48, bucket_step=8)
        assert graphed == run(model, requests, sampling, False, max_batch=48)


def diverges_only_at_a_tie(model, prompt: list[int], got: list[int], want: list[int], tol: float = 1e-3) -> bool:
    """Whether `got` equals `want`, or first leaves it where the target's two best logits after the
    common prefix are within `tol` (float32 rounding between two correct paths can pick either)."""
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if got == want:
        return True
    if n == min(len(got), len(want)):
        return False
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:n]], device="cuda")).logits[0, -1].float()
    return bool(logits[want[n]] - logits[got[n]] <= tol)


def test_later_turns_reuse_cached_pages_under_graphs_as_hf_generate(model):
    """Multi-turn chat on CUDA with graph decode: later turns prefill only what their kept pages lack
    and reply as HF `generate` on the whole prompt (float32). The cached keys of a reply come from
    decode steps, HF's from one prefill: in float32 on the GPU they differ in the last bits, so a
    reply may leave HF's only at a near-tie (the random tiny targets loop between near-equal tokens)."""
    from bench.regenerate import converse

    g = torch.Generator().manual_seed(1)
    turns = [
        [(torch.randint(5, 700, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist(), 20)] * 3
        for _ in range(12)
    ]
    settings = EngineSettings(max_batch=5, max_request_tokens=320, page_size=16)
    engine = GenerationEngine(model, stop_ids=[], sampling=SamplingParams(), settings=settings)
    asked, replies = converse(engine, turns)
    assert engine.stats["reused_prompt_tokens"] > 0
    identical = 0
    for prompt, reply in zip([p for c in asked for p in c], [r for c in replies for r in c]):
        ids = torch.tensor([prompt], device="cuda")
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.shape[1] :].tolist()
        assert diverges_only_at_a_tie(model, prompt, reply.tokens, want)
        identical += reply.tokens == want
    assert identical >= 0.75 * len(asked) * 3
