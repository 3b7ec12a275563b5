"""bench/candidate_cap.py: a drafter's expected sampled tau along target replies, with its own q and with q
cut to its top k candidates; the q's are the ones decoding samples from, checked against separate forwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.candidate_cap import acceptance, expected_tokens, main, reply_anchors, top_k_cut
from dflash_pipeline.shared.generation.sampling import SamplingParams, filtered_probs
from dflash_pipeline.shared.generation.speculative import _speculative_sample
from dflash_pipeline.shared.model.config import DFlashConfig
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache
from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target

B = 6
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)


def drafter_for(target, **dflash2) -> DFlashDrafter:
    """A 1-layer random drafter for the tiny target; with `dflash2` keys a DFlash-2 one whose selector
    codebooks are large enough to reorder its candidates."""
    cfg = DFlashConfig.for_target(
        target.config.to_dict(),
        [1, 2],
        mask_token_id=target.config.vocab_size - 1,
        num_layers=1,
        block_size=B,
        **dflash2,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(cfg, attention_backend="sdpa_dense")
    model.reset_parameters(std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "codebook" in name:
                p.normal_(0, 1.0)
    return model.eval()


def anchors_of(target, drafter, prompt, reply, every, top_ks=(3,)):
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        return reply_anchors(target, drafter, capture, prompt, reply, SAMPLING, every, list(top_ks))
    finally:
        capture.close()


@torch.no_grad()
def block_by_separate_forwards(target, drafter, prompt, reply, a):
    """(the drafter's hidden states of the block anchored at reply position a, from one fresh forward over
    all the text before it; the target's p at each drafted position, each from a forward over its prefix)."""
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        target(input_ids=torch.tensor([[*prompt, *reply[:a]]]))
        features = torch.cat(capture.take(), dim=-1)
    finally:
        capture.close()
    start = len(prompt) + a
    block = torch.full((1, B), drafter.config.mask_token_id)
    block[0, 0] = reply[a]
    hidden = drafter.forward_step(
        features,
        torch.arange(start)[None],
        target.get_input_embeddings()(block) * drafter.config.input_embedding_scale,
        torch.arange(start, start + B)[None],
        DrafterCache(),
    )[:, 1:]
    p = torch.stack(
        [
            filtered_probs(target(input_ids=torch.tensor([[*prompt, *reply[: a + j]]])).logits[0, -1], SAMPLING)
            for j in range(1, B)
        ]
    )
    return hidden, p


def test_acceptance_is_how_often_the_rejection_rule_keeps_a_draft_drawn_from_q() -> None:
    g = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(2, 5, generator=g), -1), torch.softmax(torch.randn(1, 5, generator=g) * 2, -1)
    trials = 20_000
    kept = sum(_speculative_sample(torch.multinomial(q[0], 1, generator=g), p, q, g)[0] for _ in range(trials))
    assert kept / trials == pytest.approx(float(acceptance(p[:1], q)[0]), abs=0.015)
    assert expected_tokens(torch.tensor([0.5, 0.5, 1.0, 0.0])) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


def test_the_cut_keeps_the_k_likeliest_renormalised() -> None:
    q = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    cut, keep = top_k_cut(q, 2)
    assert keep.tolist() == [[0, 1, 0, 1]] and cut[0].tolist() == pytest.approx([0, 4 / 7, 0, 3 / 7])
    whole, keep = top_k_cut(q, 4)
    assert torch.equal(whole, q / q.sum()) and bool(keep.all())


def test_a_dflash_drafters_q_is_what_decoding_samples_from_at_every_anchor(target) -> None:
    drafter = drafter_for(target)
    g = torch.Generator().manual_seed(1)
    prompt, reply = (
        torch.randint(5, 700, (7,), generator=g).tolist(),
        torch.randint(5, 700, (18,), generator=g).tolist(),
    )
    got = anchors_of(target, drafter, prompt, reply, every=4, top_ks=(3, target.config.vocab_size))
    assert len(got) == 4  # anchors 0, 4, 8, 12: each has a whole block of reply after it
    lm_head = target.get_output_embeddings().weight
    for a, anchor in zip(range(0, 13, 4), got, strict=True):
        hidden, p = block_by_separate_forwards(target, drafter, prompt, reply, a)
        q = filtered_probs(drafter.compute_logits(hidden, lm_head)[0], SAMPLING)
        torch.testing.assert_close(anchor.own, acceptance(p, q), atol=1e-5, rtol=1e-4)
        cut = torch.zeros_like(q).scatter_(-1, q.topk(3).indices, q.topk(3).values)
        torch.testing.assert_close(anchor.cut[3], acceptance(p, cut / cut.sum(-1, keepdim=True)), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(anchor.bound[3], p.gather(-1, q.topk(3).indices).sum(-1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(anchor.cut[target.config.vocab_size], anchor.own)  # all of the vocabulary: q
    assert all(bool((x.bound[3] >= x.cut[3] - 1e-6).all()) for x in got)


def test_a_dflash2_drafters_q_is_its_selectors_along_the_path_it_drew(target) -> None:
    """The reply is the selector's own sampled path, so every position's q is the one it was drawn from."""
    drafter = drafter_for(target, conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)
    g = torch.Generator().manual_seed(2)
    prompt, first = torch.randint(5, 700, (9,), generator=g).tolist(), 123
    hidden, _ = block_by_separate_forwards(target, drafter, prompt, [first] * B, 0)
    path, candidates, probs = drafter.propose(
        hidden, torch.tensor([first]), target.get_output_embeddings().weight, SAMPLING.temperature, g
    )
    reply = [first, *path[0].tolist()]
    (anchor,) = anchors_of(target, drafter, prompt, reply, every=B)
    _, p = block_by_separate_forwards(target, drafter, prompt, reply, 0)
    q = torch.zeros(B - 1, target.config.vocab_size).scatter_(-1, candidates[0], probs[0])
    torch.testing.assert_close(anchor.own, acceptance(p, q), atol=1e-5, rtol=1e-4)


def test_the_cli_reads_a_sampled_report_and_refuses_a_greedy_one(target, tiny_target_dir: Path, tmp_path: Path) -> None:
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.train.eval_cli import prompts_from

    drafter = drafter_for(target)
    drafter.save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("say it again", "count on")))
    ids = prompts_from(str(prompts), load_tokenizer(tiny_target_dir), 2, 1024)
    replies = {1: list(range(100, 113)), 0: list(range(200, 204))}  # prompt 0's reply holds no whole block
    rows = [{"prompt_index": i, "prompt_tokens": len(ids[i]), "target_tokens": r} for i, r in replies.items()]
    sampling = {"temperature": SAMPLING.temperature, "top_p": SAMPLING.top_p, "top_k": 0, "seed": 0}
    report = tmp_path / "eval.json"
    head = {"block_size": B, "sampling": sampling, "prompts_planned": 2, "tau": 1.3}
    report.write_text(json.dumps({**head, "per_prompt": rows}))
    args = ["--report", str(report), "--drafter", str(tmp_path / "drafter"), "--target", str(tiny_target_dir)]
    args += ["--prompts", str(prompts), "--every", "3", "--top-k", "3", "--device", "cpu"]
    result = main(args)
    want = anchors_of(target, drafter, ids[1], replies[1], every=3)  # anchors 0, 3, 6
    assert result["anchors"] == 3 and result["measured_tau"] == 1.3
    assert result["own"]["tau"] == pytest.approx(sum(expected_tokens(a.own) for a in want) / 3, rel=1e-5)
    assert result["top_k"]["3"]["bound"]["first_acceptance"] == pytest.approx(
        sum(float(a.bound[3][0]) for a in want) / 3, rel=1e-5
    )
    with pytest.raises(
        SystemExit, match=f"--top-k {target.config.vocab_size + 1} exceeds the vocabulary of {target.config.vocab_size}"
    ):
        main([*args, "--top-k", str(target.config.vocab_size + 1)])
    other = DFlashConfig.for_target(
        {**target.config.to_dict(), "vocab_size": 700}, [1, 2], mask_token_id=699, num_layers=1, block_size=B
    )
    DFlashDrafter(other, attention_backend="sdpa_dense").save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit, match="made for another target.*vocabulary 700"):
        main([*args[:2], "--drafter", str(tmp_path / "other"), *args[4:]])
    report.write_text(json.dumps({**head, "sampling": {**sampling, "temperature": 0.0}, "per_prompt": rows}))
    with pytest.raises(SystemExit, match="needs a report at temperature > 0"):
        main(args)
