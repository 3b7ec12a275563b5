"""The continuous-batching engine: greedy replies equal HF `generate` one prompt at a time; sampled
replies depend on the request alone (not on batch size, order or company); the sampler draws from the
filtered distribution; targets and requests it cannot run are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from bench.regenerate import converse
from dflash_pipeline.shared.generation.decoder import GenerationError, PagedKVCache, to_cache_dtype
from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine, Request
from dflash_pipeline.shared.generation.sampling import SamplingParams, choose_tokens, request_key, uniforms


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, tiny_target_dir, tiny_llama_dir):
    folder = tiny_target_dir if request.param == "qwen3" else tiny_llama_dir
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def workload(n: int, seed: int = 0) -> list[Request]:
    """Prompts of 3..40 random ids, each with its own max_new_tokens (1..30)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (n,), generator=g).tolist()
    news = torch.randint(1, 31, (n,), generator=g).tolist()
    return [
        Request(torch.randint(5, 700, (L,), generator=g).tolist(), m, key=request_key(seed, i))
        for i, (L, m) in enumerate(zip(lengths, news))
    ]


def hf_greedy(model, request: Request, stops: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([list(request.prompt)]),
        max_new_tokens=request.max_new_tokens,
        do_sample=False,
        eos_token_id=stops or None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(request.prompt)),
    )
    return out[0, len(request.prompt) :].tolist()


GREEDY = SamplingParams()


def engine(model, max_batch: int, sampling: SamplingParams = GREEDY, stops=(), page_size: int = 4):
    return GenerationEngine(
        model,
        stop_ids=stops,
        sampling=sampling,
        settings=EngineSettings(max_batch=max_batch, max_request_tokens=80, page_size=page_size),
    )


def test_greedy_replies_equal_hf_generate_one_prompt_at_a_time(model):
    requests = workload(10)
    # stop ids that occur inside some greedy replies, so several requests stop mid-reply
    free = [hf_greedy(model, r, []) for r in requests]
    stops = sorted({reply[len(reply) // 2] for reply in free[:4] if len(reply) > 2})
    want = [hf_greedy(model, r, stops) for r in requests]
    assert any(len(w) < r.max_new_tokens for w, r in zip(want, requests))  # some stopped early
    # 3 rows for 10 requests: rows are reused; page size 4: contexts cross many page boundaries
    replies = engine(model, 3, stops=stops).generate(requests)
    assert [r.tokens for r in replies] == want
    assert [r.finished for r in replies] == [w[-1] in stops for w in want]


def test_sampled_replies_depend_on_the_request_alone(model):
    requests = workload(9, seed=1)
    sampling = SamplingParams(temperature=1.3, top_p=0.9, top_k=50)
    alone = [engine(model, 1, sampling).generate([r])[0].tokens for r in requests[:3]]
    batched = [r.tokens for r in engine(model, 4, sampling).generate(requests)]
    reordered = engine(model, 3, sampling, page_size=8).generate(requests[::-1])
    assert batched[:3] == alone
    assert [r.tokens for r in reordered][::-1] == batched
    rekeyed = [Request(r.prompt, r.max_new_tokens, key=r.key + 1) for r in requests]
    assert [r.tokens for r in engine(model, 4, sampling).generate(rekeyed)] != batched


def test_uniforms_are_a_pure_function_of_key_and_step():
    keys = torch.tensor([request_key(0, i) for i in range(4096)])
    steps = torch.arange(4096)
    u = uniforms(keys, steps)
    assert torch.equal(u, uniforms(keys.flip(0), steps.flip(0)).flip(0))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02 and abs(u.var().item() - 1 / 12) < 0.005
    assert len(torch.unique(u)) > 4000


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.8),
    ],
)
def test_sampler_draws_from_the_filtered_distribution(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    want = torch.softmax(logits / params.temperature, dim=0)
    if params.top_k:
        want[torch.argsort(want, descending=True)[params.top_k :]] = 0
    if params.top_p < 1:
        order = torch.argsort(want, descending=True)
        before = torch.cumsum(want[order], 0) - want[order]
        want[order[before >= params.top_p]] = 0
    want /= want.sum()
    n = 40_000
    tokens = choose_tokens(logits.expand(n, -1).contiguous(), torch.full((n,), request_key(7)), torch.arange(n), params)
    seen = torch.bincount(tokens, minlength=len(logits)).double() / n
    assert seen[want == 0].sum() == 0  # filtered tokens never come
    assert 0.5 * (seen - want).abs().sum() < 0.01  # total variation; the unfiltered softmax is >= 0.03 away


def test_unsupported_architecture_is_refused_with_the_reason():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(GenerationError, match=r"model_type 'gpt2'.*vLLM or SGLang"):
        engine(gpt2, 2)


def test_requests_beyond_the_capacity_are_refused(model):
    eng = engine(model, 2)
    with pytest.raises(GenerationError, match="exceed"):
        eng.add("long", Request(list(range(5, 75)), max_new_tokens=20))
    with pytest.raises(GenerationError, match="KV cache"):
        GenerationEngine(
            model,
            stop_ids=[],
            sampling=SamplingParams(),
            settings=EngineSettings(max_batch=2, max_request_tokens=80, page_size=4, num_pages=10),
        )


def test_graph_buckets_pad_rows_to_the_next_multiple_of_the_step():
    from dflash_pipeline.shared.generation.engine import graph_buckets

    assert graph_buckets(512, 64) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert graph_buckets(512, 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # powers of two only
    assert graph_buckets(100, 64) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert graph_buckets(5, 64) == [1, 2, 4, 5]


def conversations(n: int, seed: int = 0) -> list[list[tuple[list[int], int]]]:
    """n conversations of 1..4 turns: user turns of 1..12 random ids, replies of at most 1..10 tokens."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    return [
        [(torch.randint(5, 700, (draw(1, 12),), generator=g).tolist(), draw(1, 10)) for _ in range(draw(1, 4))]
        for _ in range(n)
    ]


def chat_engine(model, max_batch: int, sampling=GREEDY, stops=(), reuse=True, num_pages=None):
    settings = EngineSettings(
        max_batch=max_batch, max_request_tokens=96, page_size=4, reuse_prefixes=reuse, num_pages=num_pages
    )
    return GenerationEngine(model, stop_ids=stops, sampling=sampling, settings=settings)


@pytest.mark.parametrize("rewrite", [False, True])
def test_later_turns_reuse_the_cached_conversation_and_reply_as_hf_generate(model, rewrite):
    turns = conversations(8)
    eng = chat_engine(model, 3, stops=[7, 11])
    asked, replies = converse(eng, turns, rewrite=rewrite)
    for prompts, said, conv in zip(asked, replies, turns):
        assert [r.tokens for r in said] == [
            hf_greedy(model, Request(p, L), [7, 11]) for p, (_, L) in zip(prompts, conv)
        ]
    later = sum(len(p) for prompts in asked for p in prompts[1:])
    assert 0 < eng.stats["reused_prompt_tokens"] < later  # most of every later prompt, never a whole one
    # the same replies when every turn prefills its whole conversation again
    again = chat_engine(model, 3, stops=[7, 11], reuse=False)
    assert converse(again, turns, rewrite=rewrite) == (asked, replies)
    assert again.stats["reused_prompt_tokens"] == 0
    assert again.stats["prefill_tokens"] == eng.stats["prefill_tokens"] + eng.stats["reused_prompt_tokens"]


def test_kept_caches_give_way_when_pages_run_short(model):
    """A pool for one request of the full 96 tokens: kept caches must be evicted for others to start;
    sampled replies stay the same as with room to spare, and every page comes back."""
    turns = conversations(10, seed=1)
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    roomy = chat_engine(model, 3, sampling)
    tight = chat_engine(model, 3, sampling, num_pages=24 + 1)
    assert converse(tight, turns) == converse(roomy, turns)
    assert tight.stats["evicted_caches"] > 0 and roomy.stats["evicted_caches"] == 0
    assert tight.stats["reused_prompt_tokens"] > 0
    for eng in (tight, roomy):
        assert not eng._kept and sorted(eng._free_pages) == list(range(1, eng.stats["kv_cache_pages"]))


def test_when_pages_bound_the_batch_prompts_wait_to_be_prefilled_together(model):
    """Rows to spare but pages for ~3 requests: admitting whenever a row is free prefills about one
    prompt per finished reply; waiting for a share of the pages batches them, with the same replies."""
    requests = workload(24, seed=2)

    def run(fraction: float) -> tuple[list[list[int]], int]:
        settings = EngineSettings(
            max_batch=16,
            max_request_tokens=80,
            page_size=4,
            num_pages=3 * 20 + 1,
            admit_page_fraction=fraction,
            admit_wait_steps=0,  # the page rule alone
        )
        eng = GenerationEngine(model, stop_ids=[], sampling=GREEDY, settings=settings)
        return [r.tokens for r in eng.generate(requests)], eng.stats["prefills"]

    eager, eager_prefills = run(0.0)
    batched, batched_prefills = run(0.5)
    assert batched == eager
    assert batched_prefills < eager_prefills / 2


def test_with_rows_to_spare_next_turns_wait_to_be_prefilled_together(model):
    """Fewer conversations than rows, replies ending one at a time: every finished turn's next turn
    found rows free and got a prefill of its own; waiting up to admit_wait_steps batches them, with
    the same replies."""
    g = torch.Generator().manual_seed(3)
    turns = [[(torch.randint(5, 700, (4,), generator=g).tolist(), 3 + 2 * c + t) for t in range(3)] for c in range(12)]

    def run(wait: int):
        settings = EngineSettings(max_batch=64, max_request_tokens=128, page_size=4, admit_wait_steps=wait)
        eng = GenerationEngine(model, stop_ids=[], sampling=GREEDY, settings=settings)
        return converse(eng, turns), eng.stats["prefills"]

    (eager, eager_prefills), (batched, batched_prefills) = run(0), run(8)
    assert batched == eager
    assert batched_prefills < 0.6 * eager_prefills  # 13 against 25 here


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    limit = torch.finfo(torch.float8_e4m3fn).max
    return x.clamp(-limit, limit).to(torch.float8_e4m3fn).to(x.dtype)


def fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention over keys and values rounded to fp8: what an fp8 KV cache gives attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, fp8_round_trip(key), fp8_round_trip(value), attention_mask, **kwargs)


@pytest.fixture
def hf_with_fp8_kv(model):
    """`model` whose HF attention reads fp8-rounded keys and values, for the duration of a test."""
    from transformers import AttentionInterface

    AttentionInterface.register("fp8_kv_sdpa", fp8_kv_sdpa)
    before = model.config._attn_implementation
    model.set_attn_implementation("fp8_kv_sdpa")
    yield model
    model.set_attn_implementation(before)


def test_fp8_kv_cache_replies_equal_hf_generate_attending_to_fp8_keys_and_values(model, hf_with_fp8_kv):
    """The fp8 cache changes nothing but the keys' and values' rounding: every greedy reply is HF's
    with its attention reading rounded keys and values; a later turn that reuses the cached (rounded)
    conversation replies as one that prefills it again."""
    requests = workload(8, seed=2)
    want = [hf_greedy(hf_with_fp8_kv, r, []) for r in requests]
    settings = EngineSettings(max_batch=3, max_request_tokens=80, page_size=4, kv_cache_dtype="float8_e4m3fn")
    replies = GenerationEngine(model, stop_ids=[], sampling=GREEDY, settings=settings).generate(requests)
    assert [r.tokens for r in replies] == want
    turns = conversations(6, seed=3)
    chats = []
    for reuse in (True, False):
        settings = EngineSettings(
            max_batch=3, max_request_tokens=96, page_size=4, reuse_prefixes=reuse, kv_cache_dtype="float8_e4m3fn"
        )
        chats.append(converse(GenerationEngine(model, stop_ids=[], sampling=GREEDY, settings=settings), turns))
    assert chats[0] == chats[1]
    asked, said = chats[0]
    for prompts, replies, conv in zip(asked, said, turns):
        assert [r.tokens for r in replies] == [
            hf_greedy(hf_with_fp8_kv, Request(p, L), []) for p, (_, L) in zip(prompts, conv)
        ]


def test_fp8_kv_cache_is_lossy_and_takes_one_byte_an_element(model):
    """The option changes replies on this target (so the test above tells it from the default), and
    the cache really is fp8; an unknown dtype is refused."""
    requests = workload(8, seed=2)
    runs = {}
    for dtype in (None, "float8_e4m3fn"):
        settings = EngineSettings(max_batch=3, max_request_tokens=80, page_size=4, kv_cache_dtype=dtype)
        eng = GenerationEngine(model, stop_ids=[], sampling=GREEDY, settings=settings)
        runs[dtype] = [r.tokens for r in eng.generate(requests)]
        assert eng.decoder.cache.keys[0].dtype == (torch.float8_e4m3fn if dtype else torch.float32)
    assert runs[None] != runs["float8_e4m3fn"]
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not one of"):
        EngineSettings(kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_cache_slots_round_trip_and_fp8_values_are_token_minor_and_finite(dtype):
    """What is written to a slot reads back from it, in either layout. fp8 values lie token-minor in
    memory, the layout decode attention reads them fastest in, and every fp8 slot is finite whatever
    the model computed (NaN, inf, beyond 448), since the kernel loads fp8 value pages unmasked."""
    cache = PagedKVCache.allocate(2, 5, 4, 2, 8, dtype, torch.device("cpu"))
    values = cache.values[1]
    assert values.shape == cache.keys[1].shape == (5, 4, 2, 8) and cache.keys[1].is_contiguous()
    assert cache.finite_value_tails == (dtype == torch.float8_e4m3fn)
    assert values.permute(0, 2, 3, 1).is_contiguous() == (dtype == torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)
    k, v = (100 * torch.randn(7, 2, 8, generator=g) for _ in range(2))
    v[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -1e6])
    slots = torch.tensor([4, 5, 6, 7, 13, 2, 19])  # pages 1, 3, 0 (part) and 4
    where = cache.slots(slots)
    cache.write(1, where, to_cache_dtype(k, dtype), to_cache_dtype(v, dtype))
    got_k, got_v = cache.read(1, where, torch.float32)
    assert torch.equal(got_k, to_cache_dtype(k, dtype).float())
    assert torch.equal(got_v, to_cache_dtype(v, dtype).float())
    assert torch.equal(values.reshape(-1, 2, 8)[slots].float(), got_v)  # slot t of page p: values[p, t]
    if dtype == torch.float8_e4m3fn:
        assert torch.isfinite(values.float()).all()
        limit = torch.finfo(dtype).max
        assert got_v[0, 0, :3].tolist() == [0.0, limit, -limit]
    assert torch.equal(cache.read(0, where, torch.float32)[1], torch.zeros(7, 2, 8))
