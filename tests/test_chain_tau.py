"""`dflash-eval --chain` measures greedy tau without decoding step by step (train/chain_tau.py): the
target's greedy replies first, then the drafter's blocks along them. It must count exactly what
greedy speculative decoding counts, step by step, at every --max-new-tokens, with stop tokens, for
DFlash and DFlash-2 drafters. The drafters are overfitted on the tiny target's own replies to two of
the prompts, so their blocks are accepted anywhere from 1 to B tokens (a random drafter accepts none,
and any count would pass).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from test_dflash2_generate import dflash2_drafter
from test_speculative import B, invoke_eval, prompts, random_drafter, run_eval

from dflash_pipeline.shared.generation.speculative import dflash_generate, target_generate
from dflash_pipeline.shared.model.blocks import build_blocks
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.model.target_head import TargetHead
from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target
from dflash_pipeline.train.chain_tau import BlockMatches, chain_accepted, greedy_replies, sequence_features
from dflash_pipeline.train.step import drafter_hidden

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)


def overfit(drafter: DFlashDrafter, target, sequences: list[tuple[torch.Tensor, int]], steps: int = 120):
    """`drafter` trained on blocks at every reply position of `sequences` ((ids, prompt length)) until
    it drafts much of them right; the draft CE only (a DFlash-2 selector keeps its random weights)."""
    head = TargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    batches = []
    for seq, P in sequences:
        S, doc = len(seq), torch.zeros(len(seq), dtype=torch.long)
        anchors = torch.arange(P, S - 1)
        blocks = build_blocks(seq, doc, torch.arange(S), torch.arange(S) >= P, anchors, len(anchors), B, 0)
        blocks["block_ids"][blocks["block_ids"] == 0] = drafter.config.mask_token_id
        context = sequence_features(target, capture, seq)[0].clone()
        batches.append({"context_hidden": context, "context_doc": doc, "context_positions": torch.arange(S), **blocks})
    capture.close()
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for step in range(steps):
        batch = {k: v[None] for k, v in batches[step % len(batches)].items()}
        hidden = drafter_hidden(drafter, head, batch)
        logits = drafter.compute_logits(hidden, head.lm_head)[0]
        loss = F.cross_entropy(logits, batch["labels"][0], ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def drafter(request, target, tiny_tokenizer):
    model = random_drafter(target, seed=1) if request.param == "dflash" else dflash2_drafter(target, seed=1)
    learned = []
    for p in prompts(tiny_tokenizer, 2):
        reply = target_generate(target, p, MAX_NEW, set()).tokens
        learned.append((torch.tensor([*p.tolist(), *reply]), len(p)))
    return overfit(model, target, learned)


@pytest.mark.parametrize("max_new", [MAX_NEW, 21, 9, 2])
def test_the_chain_counts_what_greedy_decoding_counts(target, drafter, tiny_tokenizer, max_new, monkeypatch):
    """Every verify step's count of `dflash_generate` at `max_new` new tokens, from replies generated
    once with MAX_NEW (the windows of --chain come from them), for learned and unseen prompts, with no
    stop token and with one that ends a reply early; the blocks drafted 7 to a pass."""
    from dflash_pipeline.train import chain_tau

    monkeypatch.setattr(chain_tau, "BLOCKS_PER_PASS", 7)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    head = TargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    asked = prompts(tiny_tokenizer, 4)
    replies = greedy_replies(target, [p.tolist() for p in asked], MAX_NEW, set())
    steps = []
    try:
        for p, reply in zip(asked, replies):
            assert reply == target_generate(target, p, MAX_NEW, set()).tokens
            sequence = torch.tensor([*p.tolist(), *reply])
            matches = BlockMatches(drafter, head, sequence_features(target, capture, sequence), sequence, len(p))
            for stop in (set(), {reply[max_new * 2 // 3]}):
                decoded = dflash_generate(target, drafter, capture, p, max_new, stop).accepted
                cut = reply if not stop else reply[: reply.index(next(iter(stop))) + 1]
                assert chain_accepted(cut, matches, max_new, B, stop) == decoded, (p.tolist(), stop)
                steps += decoded
    finally:
        capture.close()
    if max_new == MAX_NEW:  # counts of every size: whole blocks of the learned prompts, single tokens
        # (DFlash-2's random selector reorders the learned drafts, so its blocks fall short of whole)
        assert min(steps) == 1 and max(steps) >= (3 if drafter.candidate_selector is not None else B)


def test_replies_come_from_hf_where_the_engine_cannot_run_the_target(target, tiny_tokenizer, monkeypatch):
    from dflash_pipeline.shared.generation.decoder import GenerationError
    from dflash_pipeline.train import chain_tau

    asked = [p.tolist() for p in prompts(tiny_tokenizer, 2)]
    by_engine = greedy_replies(target, asked, 12, {5})

    def unsupported(model, max_context):
        raise GenerationError("model_type 'other': not run by the engine")

    monkeypatch.setattr(chain_tau, "check_supported", unsupported)
    monkeypatch.setattr(chain_tau, "GenerationEngine", None)  # any use of the engine would fail
    assert greedy_replies(target, asked, 12, {5}) == by_engine


def test_the_chain_refuses_a_reply_too_short_for_its_limit():
    with pytest.raises(ValueError, match="too short for 10"):
        chain_accepted([5, 6, 7], lambda index, size: 0, 10, B, {9})
    assert chain_accepted([5, 6, 9], lambda index, size: 0, 10, B, {9}) == [1, 1]  # ended by its stop id


def test_dflash_eval_chain_reports_tau_at_each_window(target, tiny_target_dir, sample_corpus, tmp_path):
    decoded, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path / "decode")
    chained, output = run_eval(
        target, tiny_target_dir, sample_corpus, tmp_path / "chain", "--chain", "--windows", "9,1"
    )
    assert "dflash-eval: the target's greedy replies to 3 prompts" in output
    assert re.search(rf"dflash-eval --chain: 100%\|.*\| 3/3 .*tau {chained['tau_pooled']:.2f}", output), output
    assert chained["method"] == "chain" and chained["speedup"] is None and chained["all_lossless"] is None
    assert [r["target_tokens"] for r in chained["per_prompt"]] == [r["target_tokens"] for r in decoded["per_prompt"]]
    assert [r["accepted"] for r in chained["per_prompt"]] == [r["accepted"] for r in decoded["per_prompt"]]
    assert chained["tau"] == pytest.approx(decoded["tau"]) and set(chained["windows"]) == {"9", "1"}
    assert chained["windows"]["1"]["tau"] != chained["windows"]["1"]["tau"]  # 1 new token: no verify step (nan)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--chain", "--temperature", "1"], "--chain measures greedy decoding"),
        (["--windows", "8"], "--windows needs --chain"),
        (["--chain", "--windows", "25"], "--windows must lie in 1..--max-new-tokens"),
    ],
)
def test_dflash_eval_chain_refuses_what_it_cannot_measure(tiny_target_dir, sample_corpus, tmp_path, extra, message):
    from click.testing import CliRunner

    from dflash_pipeline.train.eval_cli import main

    args = ["--target", str(tiny_target_dir), "--drafter", str(tmp_path), "--prompts", str(sample_corpus)]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "24", "--device", "cpu", *extra])
    assert result.exit_code != 0 and message in result.output


def test_sigterm_stops_dflash_eval_chain_at_once_with_one_line(
    target, tiny_target_dir, sample_corpus, tmp_path, monkeypatch
):
    """--chain batches all replies, so nothing is kept: it stops at once, says so, and exits as a shell does."""
    import signal

    from dflash_pipeline.train import chain_tau

    replies = chain_tau.greedy_replies

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return replies(*args, **kwargs)

    monkeypatch.setattr(chain_tau, "greedy_replies", signalled)
    stopped = invoke_eval(target, tiny_target_dir, sample_corpus, tmp_path, "--chain")
    assert stopped.exit_code == 143 and stopped.output.splitlines()[-1] == "dflash-eval: stopped by SIGTERM"
    assert not (tmp_path / "eval.json").exists()
