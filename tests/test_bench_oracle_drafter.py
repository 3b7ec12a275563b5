"""bench/oracle_drafter.py: the greedy-path oracle's T=1 tau and the target's distributions along replies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.oracle_drafter import main, oracle_counts, reply_stats


@pytest.fixture(scope="module")
def tiny(tiny_target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@torch.no_grad()
def counts_without_a_cache(model, prompt: list[int], reply: list[int], block_size: int, every: int) -> list[float]:
    """The oracle by its definition, each greedy step a forward over the whole text so far."""
    counts = []
    for anchor in range(0, len(reply), every):
        text, kept, count = [*prompt, *reply[: anchor + 1]], 1.0, 1.0
        for _ in range(block_size - 1):
            probs = torch.softmax(model(torch.tensor([text])).logits[0, -1], -1)
            kept *= float(probs.max())
            count += kept
            text.append(int(probs.argmax()))
        counts.append(count)
    return counts


def test_the_oracle_counts_equal_its_definition(tiny) -> None:
    g = torch.Generator().manual_seed(0)
    prompt, reply = (
        torch.randint(5, 700, (9,), generator=g).tolist(),
        torch.randint(5, 700, (21,), generator=g).tolist(),
    )
    got = oracle_counts(tiny, prompt, reply, block_size=5, every=4)
    assert len(got) == 6  # anchors 0, 4, ..., 20
    assert got == pytest.approx(counts_without_a_cache(tiny, prompt, reply, 5, 4), rel=1e-5)
    assert all(1.0 < c < 5.0 for c in got)


@torch.no_grad()
def test_reply_statistics_are_the_targets_distributions_at_each_reply_token(tiny) -> None:
    prompts, replies = [[11, 12, 13], [20, 21]], [[30, 31], [40, 41, 42]]
    stats = reply_stats(tiny, prompts, replies)
    probs = []
    for p, r in zip(prompts, replies):
        logits = tiny(torch.tensor([[*p, *r]])).logits[0]
        probs += [(torch.softmax(logits[len(p) - 1 + i], -1), t) for i, t in enumerate(r)]
    assert stats["positions"] == 5
    assert stats["mean_max_p"] == pytest.approx(sum(float(q.max()) for q, _ in probs) / 5, rel=1e-5)
    assert stats["mean_p_token"] == pytest.approx(sum(float(q[t]) for q, t in probs) / 5, rel=1e-5)
    entropy = sum(float(-(q * q.log()).sum()) for q, _ in probs) / 5
    assert stats["mean_entropy"] == pytest.approx(entropy, rel=1e-5)


def test_the_report_is_read_by_prompt_index(tiny_target_dir: Path, tiny, tmp_path: Path) -> None:
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.train.eval_cli import prompts_from

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("say it again", "count on", "and on")))
    ids = prompts_from(str(prompts), load_tokenizer(tiny_target_dir), 3, 1024)
    replies = {2: [101, 102, 103, 104, 105, 106], 0: [300, 301, 302]}  # a shard's rows: prompts 2 and 0
    rows = [{"prompt_index": i, "prompt_tokens": len(ids[i]), "target_tokens": r} for i, r in replies.items()]
    report = tmp_path / "eval.json"
    head = {"block_size": 4, "max_new_tokens": 6, "sampling": {"temperature": 1.0}, "prompts_planned": 3, "tau": 1.2}
    report.write_text(json.dumps({**head, "per_prompt": rows}))
    args = ["--report", str(report), "--target", str(tiny_target_dir), "--prompts", str(prompts), "--every", "2"]
    args += ["--device", "cpu"]
    result = main(args)
    want = [c for i, r in replies.items() for c in oracle_counts(tiny, ids[i], r, 4, 2)]
    assert result["oracle_anchors"] == 5 and result["oracle_tau"] == pytest.approx(sum(want) / 5, rel=1e-5)
    assert result["t1_replies"] == pytest.approx(reply_stats(tiny, [ids[2], ids[0]], list(replies.values())))
    assert result["greedy_replies"]["positions"] > 0

    report.write_text(json.dumps({**head, "sampling": {"temperature": 0.0}, "per_prompt": rows}))
    with pytest.raises(SystemExit, match="needs a temperature-1 report with target_tokens"):
        main(args)
    rows[0]["prompt_tokens"] += 1
    report.write_text(json.dumps({**head, "per_prompt": rows}))
    with pytest.raises(SystemExit, match="prompt 2: .* tokens with .*'s tokenizer, .* in the drafter report"):
        main(args)
