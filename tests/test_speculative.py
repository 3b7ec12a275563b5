"""DFlash speculative decoding is lossless and counts acceptance right; `dflash-eval` reports it.

The oracle test drives the real decoding loop with a drafter whose proposals are the target's own
greedy continuation, corrupted at a chosen position each step: every acceptance length from 1 to B
happens, so a wrong KV-cache crop or feature hand-off would change the target's output.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_pipeline.data.chat import stop_token_ids
from dflash_pipeline.extract.target import HiddenStateCapture, load_full_target
from dflash_pipeline.shared.drafter import DFlashConfig, DFlashDrafter
from dflash_pipeline.shared.speculative import dflash_generate, target_greedy

B = 8


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)


def random_drafter(target, seed: int = 0) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(target.config.to_dict(), [1, 2], mask_token_id=target.config.vocab_size - 1,
                                  num_layers=1, block_size=B)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, attention_backend="sdpa_dense").eval()


def prompts(tokenizer, n: int) -> list[torch.Tensor]:
    texts = ["What is a list?", "Name three colours.", "How do birds fly?", "Say hi."][:n]
    return [torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]) for t in texts]


def test_untrained_drafter_output_equals_target_greedy(target, tiny_tokenizer):
    drafter = random_drafter(target)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        for p in prompts(tiny_tokenizer, 3):
            ref = target_greedy(target, p, 40, set())
            spec = dflash_generate(target, drafter, capture, p, 40, set())
            assert spec.tokens == ref.tokens
            assert sum(spec.accepted) >= len(spec.tokens) - 1 and all(1 <= a <= B for a in spec.accepted)
    finally:
        capture.close()


def test_oracle_drafter_is_accepted_up_to_its_first_wrong_token(target, tiny_tokenizer, monkeypatch):
    p = prompts(tiny_tokenizer, 1)[0]
    n_new = 60
    ref = target_greedy(target, p, n_new + B, set()).tokens
    drafter = random_drafter(target)
    wrong_at = [3, 0, 6, 1, 7, 2, 5, 4] * 10  # index of the corrupted draft in each step (7 = none wrong)
    step = {"n": 0, "seen": 0, "fed": []}
    real_step = drafter.forward_step
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    with torch.no_grad():
        target(input_ids=torch.cat([p, torch.tensor(ref)])[None])
    full_features = torch.cat(capture.take(), dim=-1)  # what a full forward gives every position

    def spy_step(ctx, ctx_pos, emb, positions, cache):
        step["seen"] = int(positions[0, 0])
        step["fed"].extend(ctx_pos[0].tolist())
        # every token before the block has been handed over exactly once, with its true features
        assert step["fed"] == list(range(step["seen"]))
        torch.testing.assert_close(ctx, full_features[:, ctx_pos[0]], rtol=1e-4, atol=1e-4)
        return real_step(ctx, ctx_pos, emb, positions, cache)

    def oracle_logits(hidden, _weight):
        start = step["seen"] - len(p) + 1  # index, in the generated tokens, of the first draft
        want = list(ref[start : start + B - 1])
        k = wrong_at[step["n"]]
        if k < B - 1:
            want[k] = (want[k] + 1) % target.config.vocab_size
        step["n"] += 1
        logits = torch.zeros(1, B - 1, target.config.vocab_size)
        logits[0, torch.arange(B - 1), torch.tensor(want)] = 1.0
        return logits

    monkeypatch.setattr(drafter, "forward_step", spy_step)
    monkeypatch.setattr(drafter, "compute_logits", oracle_logits)
    try:
        spec = dflash_generate(target, drafter, capture, p, n_new, set())
    finally:
        capture.close()
    assert spec.tokens == ref[:n_new]
    # k correct drafts, then the target's own token: k + 1 tokens per verify step (B when none is wrong)
    expected = [min(k, B - 1) + 1 for k in wrong_at[: len(spec.accepted)]]
    assert spec.accepted[:-1] == expected[:-1]
    assert spec.tau == pytest.approx(sum(spec.accepted) / len(spec.accepted))
    assert spec.tau > 3


@torch.no_grad()
def online_and_training_logits(target, drafter, prompt: torch.Tensor, backend: str, autocast, monkeypatch):
    """(logits of every block drafted online, [blocks, B-1, V] logits of the training path for the same
    anchors of the final sequence: build_blocks + `backend` attention + stored-style features)."""
    from dflash_pipeline.shared.blocks import build_blocks
    from dflash_pipeline.shared.drafter import TargetHead
    from dflash_pipeline.train.step import drafter_hidden

    lm_head = target.get_output_embeddings().weight
    online: list[torch.Tensor] = []
    compute = drafter.compute_logits

    def recording(hidden, weight):
        logits = compute(hidden, weight)
        online.append(logits[0].clone())
        return logits

    monkeypatch.setattr(drafter, "compute_logits", recording)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        gen = dflash_generate(target, drafter, capture, prompt, 48, set())
        sequence = torch.cat([prompt, torch.tensor(gen.tokens, device=prompt.device)])
        with torch.inference_mode():
            target(input_ids=sequence[None])
        features = torch.cat(capture.take(), dim=-1)[0]  # what extraction stores for this sequence
    finally:
        capture.close()
    anchors = len(prompt) + torch.tensor([0] + gen.accepted[:-1]).cumsum(0)  # each block's first token
    assert len(online) == len(anchors) > 5
    S, dev = len(sequence), prompt.device
    blocks = build_blocks(sequence.cpu(), torch.zeros(S, dtype=torch.long), torch.arange(S), torch.ones(S, dtype=torch.bool),
                          anchors, len(anchors), B, drafter.config.mask_token_id)
    batch = {"context_hidden": features, "context_doc": torch.zeros(S, dtype=torch.long, device=dev),
             "context_positions": torch.arange(S, device=dev), **{k: v.to(dev) for k, v in blocks.items()}}
    batch = {k: v[None] for k, v in batch.items()}
    head = TargetHead(target.get_input_embeddings().weight, lm_head)
    drafter.attention_backend = backend
    with torch.no_grad(), autocast:
        hidden = drafter_hidden(drafter, head, batch, backend)
    offline = compute(hidden.float(), lm_head).reshape(len(anchors), B, -1)[:, 1:]
    return online, offline


def test_online_drafts_equal_the_training_path_on_the_same_sequence(target, tiny_tokenizer, monkeypatch):
    """Train/inference consistency: every block the decoder drafts online has the logits the training
    path gives for the same anchor of the final sequence. Positions, context visibility or feature
    hand-off that differ between the two would change them."""
    online, offline = online_and_training_logits(target, random_drafter(target, seed=3), prompts(tiny_tokenizer, 1)[0],
                                                 "sdpa_dense", torch.autocast("cpu", enabled=False), monkeypatch)
    for k, logits in enumerate(online):
        torch.testing.assert_close(logits, offline[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"block {k}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_online_drafts_match_the_compiled_training_path_on_cuda(tiny_target_dir, tiny_tokenizer, train_dtype, monkeypatch):
    """The same check on the GPU, the training side as the trainer runs it there (compiled flex,
    bf16 autocast in the second case; online decoding in float32 as dflash-eval's default): equal
    logits in float32, and in bf16 the same draft tokens wherever the float32 top-2 margin exceeds
    the bf16 noise."""
    cuda = torch.device("cuda")
    target = load_full_target(tiny_target_dir, device=cuda, dtype=torch.float32)
    drafter = random_drafter(target, seed=3).to(cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=train_dtype == "bfloat16")
    online, offline = online_and_training_logits(target, drafter, prompts(tiny_tokenizer, 1)[0].to(cuda),
                                                 "flex_compiled", autocast, monkeypatch)
    online = torch.stack(online)
    if train_dtype == "float32":
        torch.testing.assert_close(online, offline, rtol=1e-3, atol=1e-3)
        return
    top2 = online.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05 * online.abs().amax(-1)
    assert clear.float().mean() > 0.3
    assert torch.equal(online.argmax(-1)[clear], offline.argmax(-1)[clear])


def test_generation_stops_at_a_stop_token(target, tiny_tokenizer):
    p = prompts(tiny_tokenizer, 1)[0]
    ref = target_greedy(target, p, 30, set()).tokens
    stop = {ref[5]}
    first = ref.index(ref[5])
    drafter = random_drafter(target)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        spec = dflash_generate(target, drafter, capture, p, 30, stop)
    finally:
        capture.close()
    assert spec.tokens == ref[: first + 1] == target_greedy(target, p, 30, stop).tokens


def test_dflash_eval_cli_writes_a_lossless_json_report(target, tiny_target_dir, sample_corpus, tmp_path):
    from dflash_pipeline.train.eval_cli import main

    random_drafter(target).save_pretrained(tmp_path / "drafter")
    report_path = tmp_path / "eval.json"
    result = CliRunner().invoke(main, [
        "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "drafter"), "--prompts", str(sample_corpus),
        "--limit", "3", "--max-new-tokens", "24", "--device", "cpu", "--dtype", "float32", "--json", str(report_path),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["num_prompts"] == 3 and report["all_lossless"] is True
    assert report["block_size"] == B and 1 <= report["tau"] <= B and report["speedup"] > 0
    assert all(r["lossless"] and r["new_tokens"] <= 24 for r in report["per_prompt"])
    assert json.loads(result.output[result.output.index("{"):])["tau"] == pytest.approx(report["tau"])


def test_stop_token_ids_include_eos_and_end_of_turn(tiny_tokenizer):
    ids = stop_token_ids(tiny_tokenizer, None)
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert stop_token_ids(tiny_tokenizer, [5, 6]) >= {5, 6}
