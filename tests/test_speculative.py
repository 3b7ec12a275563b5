"""DFlash speculative decoding is lossless and counts acceptance right; `dflash-eval` reports it.

The oracle test drives the real decoding loop with a drafter whose proposals are the target's own
greedy continuation, corrupted at a chosen position each step: every acceptance length from 1 to B
happens, so a wrong KV-cache crop or feature hand-off would change the target's output.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from click.testing import CliRunner

from dflash_pipeline.data.chat import stop_token_ids
from dflash_pipeline.shared.generation.sampling import SamplingParams, filtered_probs
from dflash_pipeline.shared.generation.speculative import Generation, dflash_generate, target_generate
from dflash_pipeline.shared.model.config import DFlashConfig
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target

B = 8


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)


def random_drafter(target, seed: int = 0) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        target.config.to_dict(), [1, 2], mask_token_id=target.config.vocab_size - 1, num_layers=1, block_size=B
    )
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, attention_backend="sdpa_dense").eval()


def prompts(tokenizer, n: int) -> list[torch.Tensor]:
    texts = ["What is a list?", "Name three colours.", "How do birds fly?", "Say hi."][:n]
    return [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for t in texts
    ]


def test_untrained_drafter_output_equals_target_greedy(target, tiny_tokenizer):
    drafter = random_drafter(target)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        for p in prompts(tiny_tokenizer, 3):
            ref = target_generate(target, p, 40, set())
            spec = dflash_generate(target, drafter, capture, p, 40, set())
            assert spec.tokens == ref.tokens
            assert sum(spec.accepted) >= len(spec.tokens) - 1 and all(1 <= a <= B for a in spec.accepted)
    finally:
        capture.close()


def oracle_run(
    target, prompt, ref: list[int], wrong_at: list[int], max_new: int, stop: set[int], monkeypatch
) -> tuple[Generation, list[int]]:
    """dflash_generate with a drafter that proposes the target's greedy continuation `ref`, its draft
    `wrong_at[step]` corrupted (>= B-1: none); also returns the block size of every step. Checks that
    every token before a block was handed to the drafter exactly once, with its true features."""
    drafter = random_drafter(target)
    step = {"n": 0, "seen": 0, "fed": [], "sizes": []}
    real_step = drafter.forward_step
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    with torch.no_grad():
        target(input_ids=torch.cat([prompt, torch.tensor(ref)])[None])
    full_features = torch.cat(capture.take(), dim=-1)  # what a full forward gives every position

    def spy_step(ctx, ctx_pos, emb, positions, cache):
        step["seen"] = int(positions[0, 0])
        step["sizes"].append(positions.shape[1])
        step["fed"].extend(ctx_pos[0].tolist())
        assert step["fed"] == list(range(step["seen"]))
        torch.testing.assert_close(ctx, full_features[:, ctx_pos[0]], rtol=1e-4, atol=1e-4)
        return real_step(ctx, ctx_pos, emb, positions, cache)

    def oracle_logits(hidden, _weight):
        n = hidden.shape[1]
        start = step["seen"] - len(prompt) + 1  # index, in the generated tokens, of the first draft
        want = list(ref[start : start + n])
        k = wrong_at[step["n"]]
        if k < n:
            want[k] = (want[k] + 1) % target.config.vocab_size
        step["n"] += 1
        logits = torch.zeros(1, n, target.config.vocab_size)
        logits[0, torch.arange(n), torch.tensor(want)] = 1.0
        return logits

    monkeypatch.setattr(drafter, "forward_step", spy_step)
    monkeypatch.setattr(drafter, "compute_logits", oracle_logits)
    try:
        return dflash_generate(target, drafter, capture, prompt, max_new, stop), step["sizes"]
    finally:
        capture.close()


def reference_counts(ref: list[int], wrong_at: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Acceptance lengths as the reference's loop (dflash 0.1.0 model.py) counts them, in its own
    terms: `start` indexes the last output token, the block shrinks to `max_length - start`, a step
    produces min(accepted + 1, max_length - start - 1) tokens, cut after the first stop token."""
    start, max_length, lengths = 0, max_new, []
    stopped = ref[0] in stop
    while start + 1 < max_length and not stopped:
        verify_size = min(B, max_length - start)
        acceptance = min(wrong_at[len(lengths)], verify_size - 1)
        produced = min(acceptance + 1, max_length - start - 1)
        hits = [i for i, t in enumerate(ref[start + 1 : start + produced + 1]) if t in stop]
        if hits:
            produced, stopped = hits[0] + 1, True
        start += produced
        lengths.append(produced)
    return lengths


WRONG_AT = [3, 0, 6, 1, 7, 2, 5, 4] * 10  # index of the corrupted draft in each step (7 = none wrong)


def test_oracle_drafter_is_accepted_up_to_its_first_wrong_token(target, tiny_tokenizer, monkeypatch):
    p = prompts(tiny_tokenizer, 1)[0]
    n_new = 60
    ref = target_generate(target, p, n_new + B, set()).tokens
    spec, _ = oracle_run(target, p, ref, WRONG_AT, n_new, set(), monkeypatch)
    assert spec.tokens == ref[:n_new]
    # k correct drafts, then the target's own token: k + 1 tokens per verify step (B when none is wrong)
    expected = [min(k, B - 1) + 1 for k in WRONG_AT[: len(spec.accepted)]]
    assert spec.accepted[:-1] == expected[:-1]
    assert spec.tau == pytest.approx(sum(spec.accepted) / len(spec.accepted))
    assert spec.tau > 3


@pytest.mark.parametrize("n_new", [1, 2, 9, 20, 21, 37])
def test_counts_at_the_token_limit_follow_the_reference(target, tiny_tokenizer, monkeypatch, n_new):
    """The last block drafts only the tokens that are left, and a bonus token past the limit is
    neither output nor counted: every step's count equals the reference's, and they sum to the
    output length minus the first token (which comes from the prompt's forward)."""
    p = prompts(tiny_tokenizer, 1)[0]
    ref = target_generate(target, p, n_new + B, set()).tokens
    for wrong_at in ([B] * 10, WRONG_AT):
        spec, sizes = oracle_run(target, p, ref, wrong_at, n_new, set(), monkeypatch)
        assert spec.tokens == ref[:n_new]
        assert spec.accepted == reference_counts(ref, wrong_at, n_new, set())
        assert sum(spec.accepted) == n_new - 1 and max(sizes, default=B) <= B
        assert sizes == [min(B, n_new - 1 - sum(spec.accepted[:i]) + 1) for i in range(len(sizes))]


@pytest.mark.parametrize("stop_at", [0, 1, 5, 8, 12, 16])
def test_counts_stop_at_the_stop_token_like_the_reference(target, tiny_tokenizer, monkeypatch, stop_at):
    """A stop token inside an accepted block ends the output and the step's count there."""
    p = prompts(tiny_tokenizer, 1)[0]
    ref = target_generate(target, p, 40, set()).tokens
    stop = {ref[stop_at]}
    end = ref.index(ref[stop_at])  # its first occurrence
    for wrong_at in ([B] * 10, WRONG_AT):
        spec, _ = oracle_run(target, p, ref, wrong_at, 30, stop, monkeypatch)
        assert spec.tokens == ref[: end + 1] == target_generate(target, p, 30, stop).tokens
        assert spec.accepted == reference_counts(ref, wrong_at, 30, stop)
        assert sum(spec.accepted) == end


def decode_and_extract(target, drafter, prompt: torch.Tensor) -> tuple[Generation, torch.Tensor, torch.Tensor]:
    """Greedy speculative decoding of 48 tokens, then (the generation, prompt + its tokens, the
    features extraction would store for that sequence [S, layers x H])."""
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        gen = dflash_generate(target, drafter, capture, prompt, 48, set())
        sequence = torch.cat([prompt, torch.tensor(gen.tokens, device=prompt.device)])
        with torch.inference_mode():
            target(input_ids=sequence[None])
        return gen, sequence, torch.cat(capture.take(), dim=-1)[0]
    finally:
        capture.close()


@torch.no_grad()
def online_and_training_logits(target, drafter, prompt: torch.Tensor, backend: str, autocast, monkeypatch):
    """(logits of every block drafted online, [blocks, B-1, V] logits of the training path for the same
    anchors of the final sequence: build_blocks + `backend` attention + stored-style features)."""
    from dflash_pipeline.shared.model.blocks import build_blocks
    from dflash_pipeline.shared.model.target_head import TargetHead
    from dflash_pipeline.train.step import drafter_hidden

    lm_head = target.get_output_embeddings().weight
    online: list[torch.Tensor] = []
    compute = drafter.compute_logits

    def recording(hidden, weight):
        logits = compute(hidden, weight)
        online.append(logits[0].clone())
        return logits

    monkeypatch.setattr(drafter, "compute_logits", recording)
    gen, sequence, features = decode_and_extract(target, drafter, prompt)
    anchors = len(prompt) + torch.tensor([0] + gen.accepted[:-1]).cumsum(0)  # each block's first token
    assert len(online) == len(anchors) > 5
    S, dev = len(sequence), prompt.device
    blocks = build_blocks(
        sequence.cpu(),
        torch.zeros(S, dtype=torch.long),
        torch.arange(S),
        torch.ones(S, dtype=torch.bool),
        anchors,
        len(anchors),
        B,
        drafter.config.mask_token_id,
    )
    batch = {
        "context_hidden": features,
        "context_doc": torch.zeros(S, dtype=torch.long, device=dev),
        "context_positions": torch.arange(S, device=dev),
        **{k: v.to(dev) for k, v in blocks.items()},
    }
    batch = {k: v[None] for k, v in batch.items()}
    head = TargetHead(target.get_input_embeddings().weight, lm_head)
    drafter.attention_backend = backend
    with torch.no_grad(), autocast:
        hidden = drafter_hidden(drafter, head, batch)
    offline = compute(hidden.float(), lm_head).reshape(len(anchors), B, -1)[:, 1:]
    # near max_new_tokens blocks draft only what is left, so training has no blocks like them
    full = sum(len(logits) == B - 1 for logits in online)
    assert full > 5 and all(len(logits) < B - 1 for logits in online[full:])
    return online[:full], offline[:full]


def test_online_drafts_equal_the_training_path_on_the_same_sequence(target, tiny_tokenizer, monkeypatch):
    """Train/inference consistency: every block the decoder drafts online has the logits the training
    path gives for the same anchor of the final sequence. Positions, context visibility or feature
    hand-off that differ between the two would change them."""
    online, offline = online_and_training_logits(
        target,
        random_drafter(target, seed=3),
        prompts(tiny_tokenizer, 1)[0],
        "sdpa_dense",
        torch.autocast("cpu", enabled=False),
        monkeypatch,
    )
    for k, logits in enumerate(online):
        torch.testing.assert_close(logits, offline[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"block {k}: {m}")


def test_the_trainers_decoding_chain_takes_the_steps_decoding_took(target, tiny_tokenizer):
    """`tau_decode`'s chain (train.decode_tau) over blocks at every anchor of the final sequence takes
    as many steps and tokens as greedy speculative decoding did: it starts from the first reply token
    and ends at the reply's last one, as decoding does."""
    from dflash_pipeline.shared.model.blocks import anchor_candidates, build_blocks
    from dflash_pipeline.shared.model.loss import acceptance_length
    from dflash_pipeline.shared.model.target_head import TargetHead
    from dflash_pipeline.train.decode_tau import decode_chain
    from dflash_pipeline.train.step import drafter_hidden

    drafter = random_drafter(target, seed=3)
    drafter.attention_backend = "sdpa_dense"
    prompt = prompts(tiny_tokenizer, 1)[0]
    gen, sequence, features = decode_and_extract(target, drafter, prompt)
    S, doc = len(sequence), torch.zeros(len(sequence), dtype=torch.long)
    reply = torch.arange(S) >= len(prompt)
    anchors = anchor_candidates(reply, doc)
    blocks = build_blocks(sequence, doc, torch.arange(S), reply, anchors, len(anchors), B, drafter.config.mask_token_id)
    batch = {"context_hidden": features, "context_doc": doc, "context_positions": torch.arange(S), **blocks}
    lm_head = target.get_output_embeddings().weight
    with torch.no_grad():
        hidden = drafter_hidden(
            drafter, TargetHead(target.get_input_embeddings().weight, lm_head), {k: v[None] for k, v in batch.items()}
        )
        pred = drafter.compute_logits(hidden.float(), lm_head).argmax(-1).reshape(len(anchors), B)
    lengths = torch.zeros(S, dtype=torch.long)
    lengths[anchors] = acceptance_length(pred, blocks["labels"].reshape(len(anchors), B))
    tokens, steps = decode_chain(lengths, reply, doc)
    assert steps == len(gen.accepted) > 5
    # the last block may find every remaining draft right: decoding stops at its token limit there,
    # the chain counts the bonus token a longer reply would have had
    assert 0 <= tokens - sum(gen.accepted) <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_online_drafts_match_the_compiled_training_path_on_cuda(
    tiny_target_dir, tiny_tokenizer, train_dtype, monkeypatch
):
    """The same check on the GPU, the training side as the trainer runs it there (compiled flex,
    bf16 autocast in the second case; online decoding in float32 as dflash-eval's default): equal
    logits in float32, and in bf16 the same draft tokens wherever the float32 top-2 margin exceeds
    the bf16 noise."""
    cuda = torch.device("cuda")
    target = load_full_target(tiny_target_dir, device=cuda, dtype=torch.float32)
    drafter = random_drafter(target, seed=3).to(cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=train_dtype == "bfloat16")
    online, offline = online_and_training_logits(
        target, drafter, prompts(tiny_tokenizer, 1)[0].to(cuda), "flex_compiled", autocast, monkeypatch
    )
    online = torch.stack(online)
    if train_dtype == "float32":
        torch.testing.assert_close(online, offline, rtol=1e-3, atol=1e-3)
        return
    top2 = online.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05 * online.abs().amax(-1)
    assert clear.float().mean() > 0.3
    assert torch.equal(online.argmax(-1)[clear], offline.argmax(-1)[clear])


@pytest.fixture
def one_thread():
    """Tiny forwards on several threads mostly wait on each other (10x slower on a shared 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def exact_joint(target, prompt: torch.Tensor, sampling: SamplingParams, k: int) -> tuple[dict, list[torch.Tensor]]:
    """The target's exact probability of every sequence of its first `k` sampled tokens (enumerated over
    the filtered support), and each position's marginal token distribution."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    marginals = []
    for _ in range(k):
        heads = list(joint)
        with torch.inference_mode():
            logits = target(
                input_ids=torch.stack([torch.cat([prompt, torch.tensor(h, dtype=torch.long)]) for h in heads])
            ).logits[:, -1]
        probs = filtered_probs(logits, sampling)
        marginals.append(sum(joint[h] * row for h, row in zip(heads, probs)))
        joint = {
            h + (t,): joint[h] * float(row[t]) for h, row in zip(heads, probs) for t in row.nonzero()[:, 0].tolist()
        }
    return joint, marginals


def tv_to(joint: dict, samples: list[tuple[int, ...]]) -> float:
    counts = {c: samples.count(c) / len(samples) for c in set(samples)}
    return 0.5 * sum(abs(counts.get(c, 0.0) - joint.get(c, 0.0)) for c in joint.keys() | counts.keys())


def test_speculative_sampling_keeps_the_target_distribution(target, tiny_tokenizer, monkeypatch, one_thread):
    """Over many seeds the first K tokens of speculative sampling follow the target's own filtered
    distribution, as target-only sampling does. The drafter proposes each position's target marginal,
    so drafts are often accepted, often rejected, and sometimes all accepted with a bonus token (block 3,
    K = 4). The bound is Bretagnolle-Huber-Carol's: P(TV >= eps) <= 2^cells exp(-2 N eps^2) = 1e-3,
    eps = 0.12 here; measured TV: target-only 0.05, speculative 0.07, and with wrong rules: always
    accepting the drafts 0.57, resampling a rejected position from p instead of the residual 0.24."""
    K, N, block = 4, 600, 3
    sampling = SamplingParams(temperature=0.05, top_k=2)
    p = prompts(tiny_tokenizer, 1)[0]
    joint, marginals = exact_joint(target, p, sampling, K)
    eps = math.sqrt((len(joint) * math.log(2) + math.log(1000)) / (2 * N))
    drafter = random_drafter(target)
    drafted_at = {}
    real_step = drafter.forward_step

    def spy_step(ctx, ctx_pos, emb, positions, cache):
        drafted_at["first"] = int(positions[0, 0]) - len(p) + 1  # index of the first draft in the output
        return real_step(ctx, ctx_pos, emb, positions, cache)

    def marginal_logits(hidden, _weight):  # logits whose filtered distribution is the marginal
        at = drafted_at["first"]
        return torch.stack(
            [sampling.temperature * marginals[at + j].clamp_min(1e-30).log() for j in range(hidden.shape[1])]
        )[None]

    monkeypatch.setattr(drafter, "forward_step", spy_step)
    monkeypatch.setattr(drafter, "compute_logits", marginal_logits)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)

    def seeded(s: int) -> torch.Generator:
        return torch.Generator().manual_seed(s)

    try:
        spec = [dflash_generate(target, drafter, capture, p, K, set(), block, sampling, seeded(s)) for s in range(N)]
        again = dflash_generate(target, drafter, capture, p, K, set(), block, sampling, seeded(0))
    finally:
        capture.close()
    assert again.tokens == spec[0].tokens and again.accepted == spec[0].accepted  # the seed decides
    base = [tuple(target_generate(target, p, K, set(), sampling, seeded(s)).tokens) for s in range(N)]
    assert tv_to(joint, base) < eps
    assert tv_to(joint, [tuple(g.tokens) for g in spec]) < eps
    # every path was taken: rejected at once, after one accepted draft, all accepted plus the bonus
    assert {a for g in spec for a in g.accepted} == {1, 2, 3}


def test_generation_stops_at_a_stop_token(target, tiny_tokenizer):
    p = prompts(tiny_tokenizer, 1)[0]
    ref = target_generate(target, p, 30, set()).tokens
    stop = {ref[5]}
    first = ref.index(ref[5])
    drafter = random_drafter(target)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    try:
        spec = dflash_generate(target, drafter, capture, p, 30, stop)
    finally:
        capture.close()
    assert spec.tokens == ref[: first + 1] == target_generate(target, p, 30, stop).tokens


def invoke_eval(target, tiny_target_dir, prompts_path, tmp_path, *extra: str):
    """dflash-eval in this process on a random drafter (the same for the same `target`), --limit 3."""
    from dflash_pipeline.train.eval_cli import main

    random_drafter(target).save_pretrained(tmp_path / "drafter")
    return CliRunner().invoke(
        main,
        [
            "--target",
            str(tiny_target_dir),
            "--drafter",
            str(tmp_path / "drafter"),
            "--prompts",
            str(prompts_path),
            "--limit",
            "3",
            "--max-new-tokens",
            "24",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--json",
            str(tmp_path / "eval.json"),
            *extra,
        ],
    )


def run_eval(target, tiny_target_dir, prompts_path, tmp_path, *extra: str) -> tuple[dict, str]:
    result = invoke_eval(target, tiny_target_dir, prompts_path, tmp_path, *extra)
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "eval.json").read_text()), result.output


def test_dflash_eval_cli_writes_a_lossless_json_report(target, tiny_target_dir, sample_corpus, tmp_path):
    report, output = run_eval(target, tiny_target_dir, sample_corpus, tmp_path)
    assert report["num_prompts"] == 3 and report["all_lossless"] is True
    assert report["block_size"] == B and 1 <= report["tau"] <= B and report["speedup"] > 0
    rows = report["per_prompt"]
    assert all(r["lossless"] and r["new_tokens"] <= 24 for r in rows)
    assert all(r["dflash_tokens"] == r["target_tokens"] and len(r["dflash_tokens"]) == r["new_tokens"] for r in rows)
    assert all(sum(r["accepted"]) == r["new_tokens"] - 1 for r in rows)
    # tau as the reference benchmark: mean of per-prompt means; tau_pooled: all tokens over all steps
    assert report["tau"] == pytest.approx(sum(sum(r["accepted"]) / len(r["accepted"]) for r in rows) / 3)
    steps = [a for r in rows for a in r["accepted"]]
    assert report["tau_pooled"] == pytest.approx(sum(steps) / len(steps))
    assert json.loads(output[output.index("{") :])["tau"] == pytest.approx(report["tau"])
    # the progress bar's last state: every prompt, with the pooled tau and the speedup so far
    note = f"tau {report['tau_pooled']:.2f}, speedup {report['speedup']:.2f}x"
    assert re.search(rf"dflash-eval: 100%\|.*\| 3/3 .*{re.escape(note)}", output), output


def test_tau_is_the_mean_of_per_prompt_means_like_the_reference():
    from dflash_pipeline.train.eval_cli import taus

    assert taus([[8, 8], [1, 1, 1, 1], []]) == {"tau": pytest.approx(4.5), "tau_pooled": pytest.approx(20 / 6)}
    assert all(math.isnan(v) for v in taus([[]]).values())


def test_dflash_eval_reads_prompt_only_records(target, tiny_target_dir, tiny_tokenizer, tmp_path):
    from dflash_pipeline.train.eval_cli import prompts_from

    question = [{"role": "user", "content": "Name three colours."}]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"messages": question},
                {"conversations": [{"from": "human", "value": "Name three colours."}]},
                {"prompt": "Name three colours."},
                {"messages": [*question, {"role": "assistant", "content": "Red."}]},
                {
                    "messages": [
                        *question,
                        {"role": "assistant", "content": "Red."},
                        {"role": "user", "content": "More?"},
                    ]
                },
            ]
        )
        + "\n"
    )

    def ids(messages):
        return tiny_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]

    # without replies the whole record, with them up to the first reply, unless a user turn ends it
    assert prompts_from(str(path), tiny_tokenizer, 10, 1024) == [ids(question)] * 4 + [
        ids(json.loads(path.read_text().splitlines()[4])["messages"])
    ]
    report, _ = run_eval(target, tiny_target_dir, path, tmp_path)
    assert report["num_prompts"] == 3 and report["all_lossless"] is True


def test_dflash_eval_samples_without_the_lossless_check(target, tiny_target_dir, sample_corpus, tmp_path):
    args = ("--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "7")
    report, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path, *args)
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}
    assert report["all_lossless"] is None and report["lossless_check"].startswith("skipped")
    assert all(r["lossless"] is None and sum(r["accepted"]) == r["new_tokens"] - 1 for r in report["per_prompt"])
    other, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path / "other", *args[:-1], "8")
    assert [r["dflash_tokens"] for r in other["per_prompt"]] != [r["dflash_tokens"] for r in report["per_prompt"]]


def test_stop_token_ids_include_eos_and_end_of_turn(tiny_tokenizer):
    ids = stop_token_ids(tiny_tokenizer, None)
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert stop_token_ids(tiny_tokenizer, [5, 6]) >= {5, 6}


@pytest.mark.parametrize("signame, cause", [("SIGTERM", "SIGTERM"), ("SIGINT", "Ctrl-C")])
def test_sigterm_or_ctrl_c_stops_dflash_eval_at_once_and_resume_finishes_the_report(
    target, tiny_target_dir, sample_corpus, tmp_path, monkeypatch, signame, cause
):
    """SIGTERM (a deadline's `timeout`) or Ctrl-C during prompt 2 of 3 stops at once: that prompt is dropped, the
    report of the one done is written as incomplete, exit code 1 with one line; --resume decodes the other
    two, and the report then has the tokens and counts of an uninterrupted run (each prompt has its own
    seed)."""
    import signal

    from dflash_pipeline.shared.generation import speculative

    sampled = ("--temperature", "0.8", "--seed", "3")
    whole, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path / "whole", *sampled)
    calls, decode = [], speculative.dflash_generate

    def signalled_in_prompt_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the warm-up, prompt 1, then prompt 2
            os.kill(os.getpid(), getattr(signal, signame))
        return decode(*args, **kwargs)

    monkeypatch.setattr(speculative, "dflash_generate", signalled_in_prompt_2)
    handler = signal.getsignal(getattr(signal, signame))
    stopped = invoke_eval(target, tiny_target_dir, sample_corpus, tmp_path / "cut", *sampled)
    report = tmp_path / "cut" / "eval.json"
    assert stopped.exit_code == 1 and signal.getsignal(getattr(signal, signame)) == handler
    assert stopped.output.splitlines()[-1] == (
        f"dflash-eval: error: stopped by {cause} after 1 of 3 prompts; their report is {report}: "
        "rerun with --resume to finish it"
    )
    part = json.loads(report.read_text())
    assert (part["complete"], part["num_prompts"], part["prompts_planned"]) == (False, 1, 3)
    assert len(calls) == 3  # prompt 3 never started

    def decoded(rows: list[dict]) -> list[tuple]:
        return [(r["prompt_tokens"], r["dflash_tokens"], r["target_tokens"], r["accepted"]) for r in rows]

    assert decoded(part["per_prompt"]) == decoded(whole["per_prompt"][:1])
    monkeypatch.setattr(speculative, "dflash_generate", decode)
    calls.clear()
    finished, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path / "cut", *sampled, "--resume")
    assert finished["per_prompt"][:1] == part["per_prompt"]  # kept as it was, timings too
    assert decoded(finished["per_prompt"]) == decoded(whole["per_prompt"])
    assert (finished["complete"], finished["num_prompts"], finished["tau"]) == (True, 3, whole["tau"])


def test_dflash_eval_resumes_only_a_report_of_the_same_run(target, tiny_target_dir, sample_corpus, tmp_path):
    """--resume extends a finished report to a larger --limit, keeping its prompts as they are; it refuses a
    report made with other settings or other prompts, in one line each."""
    from dflash_pipeline.train.eval_cli import main

    first, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path)
    longer, _ = run_eval(target, tiny_target_dir, sample_corpus, tmp_path, "--resume", "--limit", "4")
    assert (longer["num_prompts"], longer["complete"]) == (4, True) and longer["per_prompt"][:3] == first["per_prompt"]
    other = invoke_eval(target, tiny_target_dir, sample_corpus, tmp_path, "--resume", "--temperature", "1")
    assert other.exit_code == 1 and other.output.splitlines()[-1] == (
        f"dflash-eval: error: {tmp_path / 'eval.json'}: made with other sampling; "
        "--resume continues a report of the same run"
    )
    shifted = tmp_path / "shifted.jsonl"
    shifted.write_text("".join(sample_corpus.read_text().splitlines(keepends=True)[1:]))
    first["prompts"] = str(shifted)
    (tmp_path / "eval.json").write_text(json.dumps(first))
    moved = invoke_eval(target, tiny_target_dir, shifted, tmp_path, "--resume")
    assert moved.exit_code == 1 and moved.output.splitlines()[-1] == (
        f"dflash-eval: error: {tmp_path / 'eval.json'}: its prompts are not the first 3 of {shifted} now"
    )
    no_json = CliRunner().invoke(main, ["--target", "t", "--drafter", "d", "--prompts", "p", "--resume"])
    assert no_json.exit_code != 0 and "--resume continues a --json report of decoding" in no_json.output


def test_sharded_evaluations_merge_into_the_report_of_one_process(target, tiny_target_dir, sample_corpus, tmp_path):
    """--shards 2: the shards decode every other prompt with the prompt's own seed, so merge_reports gives
    the tokens, counts and tau of one process's run; a shard with no prompt writes a complete empty report;
    reports that are not the shards of one evaluation are refused in one line."""
    from dflash_pipeline.shared.runtime.errors import UserError
    from dflash_pipeline.train.eval_cli import merge_reports

    def shard(name: str, *extra: str) -> dict:  # the same drafter folder for all: reports name it
        result = invoke_eval(target, tiny_target_dir, sample_corpus, tmp_path, "--json", str(tmp_path / name), *extra)
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / name).read_text())

    sampled = ("--temperature", "0.8", "--seed", "3")
    whole = shard("whole.json", *sampled)
    parts = [shard(f"{i}.json", *sampled, "--shards", "2", "--shard", str(i)) for i in (1, 0)]
    assert [[r["prompt_index"] for r in p["per_prompt"]] for p in parts] == [[1], [0, 2]]
    merged = merge_reports(parts)

    def decoded(report: dict) -> list[tuple]:
        rows = report["per_prompt"]
        return [(r["prompt_index"], r["dflash_tokens"], r["target_tokens"], r["accepted"]) for r in rows]

    assert decoded(merged) == decoded(whole)
    assert (merged["tau"], merged["tau_pooled"]) == (whole["tau"], whole["tau_pooled"])
    assert (merged["complete"], merged["num_prompts"], merged["shard"], merged["shards"]) == (True, 3, None, 2)
    assert merged["speedup"] == pytest.approx(
        sum(r["target_s"] for r in merged["per_prompt"]) / sum(r["dflash_s"] for r in merged["per_prompt"])
    )
    empty = shard("empty.json", *sampled, "--shards", "4", "--shard", "3")
    assert (empty["complete"], empty["num_prompts"], empty["per_prompt"]) == (True, 0, [])
    with pytest.raises(UserError, match=r"not the shards 0..N-1 of one evaluation \(shard/shards: 1/2, 3/4\)"):
        merge_reports([parts[0], empty])
    greedy = shard("greedy.json", "--shards", "2", "--shard", "0")
    with pytest.raises(UserError, match="^merge_reports: the shards were made with other sampling$"):
        merge_reports([parts[0], greedy])
