"""Drafters made by this pipeline work in the DFlash reference package (z-lab `dflash` 0.1.0).

The reference's `DFlashDraftModel` is the client our drafters must satisfy: it must load a drafter
saved by `DFlashDrafter.save_pretrained` with every weight and setting, compute the same block hidden
states from the same target, fresh and with its KV cache, and its `dflash_generate` must draft and
produce what ours does. Everything runs in float32 on the CPU with the tiny Qwen3 target.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dflash_pipeline.data.chat import stop_token_ids
from dflash_pipeline.shared.generation.speculative import dflash_generate
from dflash_pipeline.shared.model.config import DFlashConfig, default_target_layer_ids
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache
from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target

ref = pytest.importorskip(
    "dflash.model", reason="the DFlash reference package (`dflash`, in the test extra) is not installed"
)

B = 8
SAME = dict(rtol=0, atol=1e-6)  # same ops in the same order: a few ulp of O(1) values at most
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the reference's call


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def made(target, tmp_path_factory) -> tuple[DFlashDrafter, Path]:
    """A 2-layer drafter for the tiny target and the folder it saved itself to, as training does
    (weights drawn wider than the 0.02 init so that every weight visibly moves the output)."""
    n_layers = target.config.num_hidden_layers
    cfg = DFlashConfig.for_target(
        target.config,
        default_target_layer_ids(n_layers),
        num_layers=2,
        block_size=B,
        mask_token_id=target.config.vocab_size - 1,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, attention_backend="sdpa_dense")
    drafter.reset_parameters(std=0.2)
    return drafter.eval(), drafter.save_pretrained(tmp_path_factory.mktemp("drafter"))


@pytest.fixture(scope="module")
def ours(made) -> DFlashDrafter:
    return made[0]


@pytest.fixture(scope="module")
def reference(made):
    """The reference's `DFlashDraftModel` loaded from that folder, and its loading report."""
    model, info = ref.DFlashDraftModel.from_pretrained(made[1], dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def context_features(target, ours, reference, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's context feature of `ids` [1, S, n*H], as each side extracts it with its own layer ids."""
    capture = HiddenStateCapture(target, ours.config.target_layer_ids)
    try:
        with torch.no_grad():
            out = target(input_ids=ids[None], output_hidden_states=True)
        mine = torch.cat(capture.take(), dim=-1)
    finally:
        capture.close()
    return mine, ref.extract_context_feature(out.hidden_states, reference.target_layer_ids)


def block_embeds(target, ours, anchor: int) -> torch.Tensor:
    block = torch.full((1, B), ours.config.mask_token_id)
    block[0, 0] = anchor
    return target.get_input_embeddings()(block) * ours.config.input_embedding_scale


def dense_mask_all(context_len: int) -> torch.Tensor:
    """Every block token sees the whole context and its whole block (what inference does)."""
    return torch.ones(1, 1, B, context_len + B, dtype=torch.bool)


def test_reference_loads_our_drafter_with_every_weight_and_setting(ours, reference):
    """No missing, unexpected or reshaped key; every tensor equal; the same layer ids, block size and
    mask token; non-causal, full attention."""
    model, info = reference
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    theirs, mine = model.state_dict(), ours.state_dict()
    assert sorted(theirs) == sorted(mine)
    for name, value in mine.items():
        assert torch.equal(theirs[name], value), name
    assert list(model.target_layer_ids) == ours.config.target_layer_ids
    assert (model.block_size, model.mask_token_id) == (ours.config.block_size, ours.config.mask_token_id)
    assert not any(layer.self_attn.is_causal or layer.self_attn.sliding_window for layer in model.layers)


def test_reference_computes_our_block_hidden_states_fresh_and_cached(target, ours, reference, tiny_tokenizer):
    """Both drafters draft two blocks from the target's real features (the second one after five more
    accepted tokens); the reference's fresh forward, its cached forward, our training forward and our
    cached inference step agree: each of ours with the reference's counterpart to 1e-6 (bit for bit on
    torch 2.13 CPU), cached and fresh to 1e-5 (outputs are O(1))."""
    model, _ = reference
    ids = prompt_ids(tiny_tokenizer, "How do birds fly?")
    mine, theirs = context_features(target, ours, model, ids)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    my_cache, their_cache = DrafterCache(), ref._make_cache(model.config)
    fed = 0
    for c in (len(ids) - 6, len(ids) - 1):  # context: positions [0, c); block: c .. c+B-1, anchored on ids[c]
        emb = block_embeds(target, ours, int(ids[c]))
        ctx_pos, block_pos = torch.arange(c)[None], torch.arange(c, c + B)[None]
        with torch.no_grad():
            fresh = model(
                target_hidden=theirs[:, :c], noise_embedding=emb, position_ids=torch.cat([ctx_pos, block_pos], dim=1)
            )
            cached = model(
                target_hidden=theirs[:, fed:c],
                noise_embedding=emb,
                past_key_values=their_cache,
                position_ids=torch.cat([ctx_pos[:, fed:], block_pos], dim=1),
                use_cache=True,
            )
            ref._crop_to(their_cache, c)
            train = ours(mine[:, :c], emb, ctx_pos, block_pos, dense_mask_all(c))
            step = ours.forward_step(mine[:, fed:c], ctx_pos[:, fed:], emb, block_pos, my_cache)
        torch.testing.assert_close(train, fresh, **SAME)
        torch.testing.assert_close(step, cached, **SAME)
        torch.testing.assert_close(cached, fresh, rtol=0, atol=1e-5)  # projecting fewer rows rounds differently
        fed = c


def test_reference_dflash_generate_drafts_and_outputs_what_ours_does(
    target, ours, reference, tiny_tokenizer, monkeypatch
):
    """Greedy, same prompts: the same output tokens and acceptance lengths, and step by step the same
    draft logits. (An untrained drafter is almost never accepted: the next test covers acceptance.)"""
    model, _ = reference
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # return_stats times with CUDA syncs
    stop = stop_token_ids(tiny_tokenizer)
    drafts = {"ours": [], "ref": []}

    def recorded(side: str, compute_logits):
        def spy(hidden, head):
            drafts[side].append(compute_logits(hidden, head))
            return drafts[side][-1]

        return spy

    monkeypatch.setattr(ours, "compute_logits", recorded("ours", ours.compute_logits))
    monkeypatch.setattr(model, "compute_logits", recorded("ref", model.compute_logits))
    capture = HiddenStateCapture(target, ours.config.target_layer_ids)
    try:
        for text, n_new in [("What is a list?", 37), ("Name three colours.", 40), ("Say hi.", 21)]:
            ids = prompt_ids(tiny_tokenizer, text)
            mine = dflash_generate(target, ours, capture, ids, n_new, stop)
            theirs = ref.dflash_generate(model, target, ids[None], n_new, sorted(stop), return_stats=True)
            assert mine.tokens == theirs.output_ids[0, len(ids) :].tolist()
            assert mine.accepted == theirs.acceptance_lengths
    finally:
        capture.close()
    assert len(drafts["ours"]) == len(drafts["ref"]) > 3
    for a, b in zip(drafts["ours"], drafts["ref"]):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=0, atol=1e-5)


def test_reference_and_our_loops_accept_the_same_drafts_up_to_limits_and_stop_tokens(
    target, ours, reference, tiny_tokenizer, monkeypatch
):
    """Both loops draft the target's own greedy continuation with one token made wrong at a chosen
    place each step (none in some steps), so acceptance lengths 1..B all happen; a token limit and a
    stop token fall inside blocks. Both give the target's greedy tokens and the same acceptance lengths."""
    model, _ = reference
    vocab = target.config.vocab_size
    wrong_at = [3, 0, B - 1, 1, 6, 2, B - 1, 5, 4] * 10  # index of the wrong draft in each step; B-1: none
    state = {}

    def track(side: str, forward, block_start):
        def spy(*args, **kwargs):
            state[side]["seen"] = block_start(args, kwargs)
            return forward(*args, **kwargs)

        return spy

    def oracle(side: str):
        def logits(hidden, _head):
            seen, step = state[side]["seen"], state[side]["step"]
            state[side]["step"] += 1
            first = seen + 1 - state["prompt_len"]  # index, in the generated tokens, of the first draft
            want = torch.tensor(state["greedy"][first : first + hidden.shape[1]])
            if wrong_at[step] < len(want):
                want[wrong_at[step]] = (want[wrong_at[step]] + 1) % vocab
            return torch.nn.functional.one_hot(want, vocab).float()[None]

        return logits

    monkeypatch.setattr(
        ours,
        "forward_step",
        track(
            "ours",
            ours.forward_step,
            lambda a, k: int((k["block_positions"] if "block_positions" in k else a[3])[0, 0]),
        ),
    )
    monkeypatch.setattr(
        model,
        "forward",
        track("ref", model.forward, lambda a, k: int(k["position_ids"][0, -k["noise_embedding"].shape[1]])),
    )
    monkeypatch.setattr(ours, "compute_logits", oracle("ours"))
    monkeypatch.setattr(model, "compute_logits", oracle("ref"))
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    capture = HiddenStateCapture(target, ours.config.target_layer_ids)
    seen_lengths = set()
    try:
        # limit inside the last block; stop tokens met inside a block (checked by hand: steps cut to 5 of 7, 4 of 8)
        for text, n_new, stop_after in [
            ("What is a list?", 37, None),
            ("Name three colours.", 60, 20),
            ("Say hi.", 29, 9),
        ]:
            ids = prompt_ids(tiny_tokenizer, text)
            greedy = ref.dflash_generate(model, target, ids[None], n_new + B, None, block_size=1)[
                0, len(ids) :
            ].tolist()
            stop: set[int] = set()
            at = n_new
            if stop_after is not None:  # the first token, from index stop_after on, not generated before
                at = next(i for i in range(stop_after, len(greedy)) if greedy[i] not in greedy[:i])
                stop = {greedy[at]}
            state.update(greedy=greedy, prompt_len=len(ids), ours={"step": 0}, ref={"step": 0})
            mine = dflash_generate(target, ours, capture, ids, n_new, stop)
            theirs = ref.dflash_generate(model, target, ids[None], n_new, sorted(stop), return_stats=True)
            expected = greedy[: min(n_new, at + 1)]
            assert theirs.output_ids[0, len(ids) :].tolist() == expected
            assert mine.tokens == expected
            assert mine.accepted == theirs.acceptance_lengths, text
            seen_lengths.update(mine.accepted)
    finally:
        capture.close()
    assert {1, 2, B} <= seen_lengths
