"""Speculative decoding with a DFlash-2 drafter drafts the candidate selector's path, as the reference
(z-lab `dflash` 0.1.0 `dflash_generate` with a `DFlash2DraftModel`) does: greedy, the same tokens and
acceptance lengths as the reference and the target's own greedy output; sampled, the selector's
distribution over its candidates is the q of the rejection rule, so the output keeps the target's
distribution, and from the same random stream it draws the same tokens as the reference. A tiny random
DFlash-2 drafter for the tiny Qwen3 target, in float32 on the CPU.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_dflash2 import randomized
from test_speculative import exact_joint, one_thread, prompts, tv_to  # noqa: F401 (one_thread: a fixture)

from dflash_pipeline.data.chat import stop_token_ids
from dflash_pipeline.shared.generation.sampling import SamplingParams
from dflash_pipeline.shared.generation.speculative import dflash_generate, target_generate
from dflash_pipeline.shared.model.config import DFlashConfig, default_target_layer_ids
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target

ref = pytest.importorskip(
    "dflash.model", reason="the DFlash reference package (`dflash`, in the test extra) is not installed"
)

B = 8
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the reference's call


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)


def dflash2_drafter(target, seed: int = 0, block_size: int = B) -> DFlashDrafter:
    """A 2-layer DFlash-2 drafter for the tiny target, every weight random and visible: convolutions far
    from the identity, norms away from 1, selector codebooks large enough to reorder the candidates."""
    cfg = DFlashConfig.for_target(
        target.config,
        default_target_layer_ids(target.config.num_hidden_layers),
        num_layers=2,
        block_size=block_size,
        mask_token_id=target.config.vocab_size - 1,
        conv_kernel_size=3,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=6,
    )
    torch.manual_seed(seed)
    return randomized(DFlashDrafter(cfg, attention_backend="sdpa_dense"))


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory) -> tuple[DFlashDrafter, Path]:
    model = dflash2_drafter(target)
    return model, model.save_pretrained(tmp_path_factory.mktemp("dflash2"))


@pytest.fixture(scope="module")
def reference(saved):
    model, info = ref.DFlash2DraftModel.from_pretrained(saved[1], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def spy_selector(monkeypatch, drafter: DFlashDrafter) -> tuple[list[bool], list[list[int]]]:
    """Records, per drafted block, whether the selector's path differs from the per-position argmax,
    and the path."""
    reordered: list[bool] = []
    paths: list[list[int]] = []
    real = drafter.propose

    def propose(hidden, anchors, weight, temperature=0.0, generator=None):
        path, candidates, probs = real(hidden, anchors, weight, temperature, generator)
        reordered.append(not torch.equal(path, drafter.compute_logits(hidden, weight).argmax(-1)))
        paths.append(path[0].tolist())
        return path, candidates, probs

    monkeypatch.setattr(drafter, "propose", propose)
    return reordered, paths


def test_greedy_dflash2_outputs_what_the_reference_does_and_the_target_greedy(
    target, saved, reference, tiny_tokenizer, monkeypatch
):
    """Same prompts, greedy: our loop and the reference's give the same tokens and acceptance lengths,
    and they are the target's own greedy tokens (lossless). Block by block both draft the same path
    (the drafts of an untrained drafter are almost never accepted: the next test covers acceptance), and
    it differs from the argmax in some blocks (so drafting the argmax would not pass)."""
    ours, _ = saved
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # return_stats times with CUDA syncs
    reordered, paths = spy_selector(monkeypatch, ours)
    their_paths = []
    real_propose = reference.propose

    def their_propose(*args):
        out = real_propose(*args)
        their_paths.append(out[0][0].tolist())
        return out

    monkeypatch.setattr(reference, "propose", their_propose)
    stop = stop_token_ids(tiny_tokenizer)
    capture = HiddenStateCapture(target, ours.config.target_layer_ids)
    try:
        for p, n_new in zip(prompts(tiny_tokenizer, 3), (37, 40, 21)):
            mine = dflash_generate(target, ours, capture, p, n_new, stop)
            theirs = ref.dflash_generate(reference, target, p[None], n_new, sorted(stop), return_stats=True)
            assert mine.tokens == theirs.output_ids[0, len(p) :].tolist()
            assert mine.accepted == theirs.acceptance_lengths
            assert mine.tokens == target_generate(target, p, n_new, stop).tokens
    finally:
        capture.close()
    assert len(reordered) > 3 and any(reordered)
    assert paths == their_paths


def draft_the_greedy_continuation(monkeypatch, target, ours, reference, strength: float) -> dict:
    """Both drafters' logits become `strength` * one-hot of the target's greedy continuation (set in the
    returned state as `greedy`, with `prompt_len`), with one token made wrong at a chosen place each step
    (none in some steps)."""
    vocab = target.config.vocab_size
    wrong_at = [3, 0, B - 1, 1, 6, 2, B - 1, 5, 4] * 10
    state = {}

    def oracle(side: str):
        def logits(hidden, _head):
            step = state[side]
            state[side] += 1
            first = state["at_" + side] + 1 - state["prompt_len"]  # index of the first draft in the output
            want = torch.tensor(state["greedy"][first : first + hidden.shape[1]])
            if wrong_at[step] < len(want):
                want[wrong_at[step]] = (want[wrong_at[step]] + 1) % vocab
            return strength * torch.nn.functional.one_hot(want, vocab).float()[None]

        return logits

    real_step, real_forward = ours.forward_step, reference.forward

    def step_spy(ctx, ctx_pos, emb, positions, cache):
        state["at_ours"] = int(positions[0, 0])
        return real_step(ctx, ctx_pos, emb, positions, cache)

    def forward_spy(*args, **kwargs):
        state["at_ref"] = int(kwargs["position_ids"][0, -kwargs["noise_embedding"].shape[1]])
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(ours, "forward_step", step_spy)
    monkeypatch.setattr(reference, "forward", forward_spy)
    monkeypatch.setattr(ours, "compute_logits", oracle("ours"))
    monkeypatch.setattr(reference, "compute_logits", oracle("ref"))
    return state


def test_greedy_dflash2_accepts_what_the_reference_accepts(target, saved, reference, tiny_tokenizer, monkeypatch):
    """Both drafters' logits favour the target's greedy continuation with one token made wrong at a chosen
    place each step (none in some steps), strongly enough that the selector's path follows them; acceptance
    lengths 1..B happen, both loops count them alike and give the target's greedy tokens."""
    ours, _ = saved
    state = draft_the_greedy_continuation(monkeypatch, target, ours, reference, 100.0)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    capture = HiddenStateCapture(target, ours.config.target_layer_ids)
    lengths = set()
    try:
        for p, n_new in zip(prompts(tiny_tokenizer, 3), (37, 60, 29)):
            greedy = target_generate(target, p, n_new + B, set()).tokens
            state.update(greedy=greedy, prompt_len=len(p), ours=0, ref=0)
            mine = dflash_generate(target, ours, capture, p, n_new, set())
            theirs = ref.dflash_generate(reference, target, p[None], n_new, None, return_stats=True)
            assert theirs.output_ids[0, len(p) :].tolist() == mine.tokens == greedy[:n_new]
            assert mine.accepted == theirs.acceptance_lengths
            lengths.update(mine.accepted)
    finally:
        capture.close()
    assert {1, 2, B} <= lengths


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("top_k", [1, 2, 0])
def test_sampled_dflash2_draws_what_the_reference_draws_from_the_same_stream(
    target, saved, reference, tiny_tokenizer, monkeypatch, top_k
):
    """Sampled, both loops on torch's global generator seeded alike: the same tokens and acceptance
    lengths (the draws come in the same order and shapes: the first token, then per block the
    selector's one draw per position, the acceptance uniforms, the bonus or residual token). The drafts
    lean to the target's greedy continuation. top_k 1: the target's p is its greedy token, so drafts are
    accepted, several at a time, up to the first one the selector sampled off it; top_k 2 and 0 (the
    tiny target is close to uniform at temperature 1): drafts are mostly rejected and the token resampled
    from the residual p - q. (top_k filters the target's p only, not the selector's q, in both.)"""
    ours, _ = saved
    state = draft_the_greedy_continuation(monkeypatch, target, ours, reference, 5.0)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    sampling = SamplingParams(temperature=1.0, top_k=top_k)
    capture = HiddenStateCapture(target, ours.config.target_layer_ids)
    lengths = []
    try:
        for seed, p in enumerate(prompts(tiny_tokenizer, 3)):
            state.update(greedy=target_generate(target, p, 40 + B, set()).tokens, prompt_len=len(p), ours=0, ref=0)
            torch.manual_seed(seed)
            mine = dflash_generate(target, ours, capture, p, 40, set(), sampling=sampling)
            torch.manual_seed(seed)
            theirs = ref.dflash_generate(
                reference, target, p[None], 40, None, temperature=1.0, top_k=top_k, return_stats=True
            )
            assert mine.tokens == theirs.output_ids[0, len(p) :].tolist()
            assert mine.accepted == theirs.acceptance_lengths
            lengths += mine.accepted
    finally:
        capture.close()
    assert 1 in lengths and (top_k != 1 or max(lengths) > 3)


@pytest.mark.usefixtures("one_thread")
def test_sampled_dflash2_keeps_the_target_distribution(target, tiny_tokenizer, monkeypatch):
    """As `test_speculative_sampling_keeps_the_target_distribution` for DFlash: over many seeds the
    first K tokens follow the target's filtered distribution within the same bound. The drafter's logits
    are each position's target marginal; the selector re-ranks them with its transition scores (small
    random codebooks), so its q is near the marginal but not it, and drafts are rejected at once, after
    one, or all accepted with the bonus."""
    K, N, block = 4, 600, 3
    sampling = SamplingParams(temperature=0.05, top_k=2)
    p = prompts(tiny_tokenizer, 1)[0]
    joint, marginals = exact_joint(target, p, sampling, K)
    eps = math.sqrt((len(joint) * math.log(2) + math.log(1000)) / (2 * N))
    drafter = dflash2_drafter(target, block_size=block)
    with torch.no_grad():
        for c in (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook):
            c.mul_(0.1)
    drafted_at = {}
    real_step = drafter.forward_step

    def spy_step(ctx, ctx_pos, emb, positions, cache):
        drafted_at["first"] = int(positions[0, 0]) - len(p) + 1
        return real_step(ctx, ctx_pos, emb, positions, cache)

    def marginal_logits(hidden, _weight):
        at = drafted_at["first"]
        return torch.stack(
            [sampling.temperature * marginals[at + j].clamp_min(1e-30).log() for j in range(hidden.shape[1])]
        )[None]

    monkeypatch.setattr(drafter, "forward_step", spy_step)
    monkeypatch.setattr(drafter, "compute_logits", marginal_logits)
    reordered, _ = spy_selector(monkeypatch, drafter)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)

    def seeded(s: int) -> torch.Generator:
        return torch.Generator().manual_seed(s)

    try:
        spec = [dflash_generate(target, drafter, capture, p, K, set(), block, sampling, seeded(s)) for s in range(N)]
        again = dflash_generate(target, drafter, capture, p, K, set(), block, sampling, seeded(0))
    finally:
        capture.close()
    assert again.tokens == spec[0].tokens and again.accepted == spec[0].accepted  # the seed decides
    assert tv_to(joint, [tuple(g.tokens) for g in spec]) < eps
    assert {a for g in spec for a in g.accepted} == {1, 2, 3}
    assert any(reordered)  # the selector's draws are not the marginal's argmax throughout


def test_dflash_eval_runs_a_dflash2_drafter_losslessly(target, tiny_target_dir, sample_corpus, tmp_path, monkeypatch):
    """The CLI loads a DFlash-2 folder and drafts with its selector; greedy, every prompt is lossless."""
    from dflash_pipeline.train.eval_cli import main

    proposed = []
    real = DFlashDrafter.propose

    def propose(self, *args, **kwargs):
        proposed.append(self.config.arch)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "propose", propose)
    dflash2_drafter(target).save_pretrained(tmp_path / "drafter")
    report_path = tmp_path / "eval.json"
    args = ["--target", str(tiny_target_dir), "--drafter", str(tmp_path / "drafter"), "--prompts"]
    args += [str(sample_corpus), "--limit", "3", "--max-new-tokens", "24", "--device", "cpu", "--dtype", "float32"]
    result = CliRunner().invoke(main, [*args, "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["num_prompts"] == 3 and report["all_lossless"] is True and report["block_size"] == B
    assert all(r["dflash_tokens"] == r["target_tokens"] for r in report["per_prompt"])
    assert len(proposed) >= 3 and set(proposed) == {"dflash2"}
