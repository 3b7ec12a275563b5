"""bench/regenerate.py end to end on CPU at tiny sizes: every contender runs, each reply ends at its
drawn length, and the JSON carries the rates, the bounds and the recipe estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.regenerate import draw_lengths, main


def test_bench_regenerate_smoke(tmp_path: Path) -> None:
    out = tmp_path / "regenerate.json"
    returned = main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--requests",
            "6",
            "--baseline-requests",
            "4",
            "--max-prompt",
            "24",
            "--max-reply",
            "12",
            "--batch",
            "4",
            "--sampled",
            "--profile-prefill",
            "3",
            "--projection-rows",
            "5",
            "--profile-decode",
            "3",
            "--profile-decode-context",
            "20",
            "--overlap-rows",
            "6",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["errors"] == [] and "partial" not in result
    assert set(result) >= {
        "workload",
        "copy_bandwidth_GBps",
        "weight_bytes",
        "weight_bytes_read_per_step",
        "kv_bytes_per_token",
        "engine",
        "hf_generate",
        "recipe_estimate",
    }
    drawn = result["workload"]["reply_tokens"]["total"]
    assert result["workload"]["requests"] == 6
    # tiny target: 4 layers x 2 kv heads x head_dim 16, float32
    assert result["kv_bytes_per_token"] == 2 * 4 * 2 * 16 * 4
    assert result["weight_bytes_read_per_step"] < result["weight_bytes"]  # untied: the embedding table is left out
    assert result["matmul_flops_per_token"] == 2 * result["weight_bytes_read_per_step"] // 4  # 4-byte weights
    assert result["matmul_TFLOPs"] > 0

    assert [(r["batch"], r["sampling"]) for r in result["engine"]] == [(4, "greedy"), (4, "sampled")]
    for row in result["engine"]:
        assert row["generated_tokens"] == row["stats"]["generated_tokens"] == row["useful_tokens"] == drawn
        assert row["length_mismatches"] == 0 and row["finished_by_stop"] == 0
        assert row["stats"]["requests"] == 6  # this call's counters only, not the warm-up's
        assert row["tokens_per_s"] > 0 and row["bound_tok_s"] > 0 and row["schedule_bound_tok_s"] > 0
        assert 0 < row["fraction_of_bound"] and 0 < row["fraction_of_schedule_bound"]
        # the roofline charges the schedule's bytes and the matmuls on top: never less time than the bytes alone
        st, flops = row["stats"], result["matmul_flops_per_token"]
        assert row["roofline_s"] >= row["schedule_bound_s"] + st["prefill_tokens"] * flops / (
            result["matmul_TFLOPs"] * 1e12
        )
        assert row["fraction_of_roofline"] == pytest.approx(row["roofline_s"] / row["seconds"])
        assert row["mean_active_rows"] <= 4
        assert {"vs_hf_batch32", "vs_hf_batch256"} <= set(row)
    # float32 on CPU: the engine's greedy replies are HF's
    agreement = result["engine"][0]["greedy_agreement_hf_batch32"]
    assert agreement["rows"] > 0 and agreement["common_prefix_fraction"] == 1.0

    assert [r["batch"] for r in result["hf_generate"]] == [32, 256]
    for row in result["hf_generate"]:
        assert row["requests"] == 4 and row["length_mismatches"] == 0
        assert row["useful_tokens"] == row["generated_tokens"] == row["drawn_tokens"] > 0

    profiled = result["prefill_profile"]
    assert profiled["prompts"] == 3 and profiled["by_host_time"] and profiled["by_device_time"]
    assert any("mm" in r["op"] for r in profiled["by_host_time"])  # the projections ran inside the profile

    (decode,) = result["decode_profile"]
    assert decode["rows"] == 3 and decode["context"] == 20 and decode["device_ms"] > 0
    assert any("mm" in r["op"] or "linear" in r["op"] for r in decode["by_device_time"])

    (overlap,) = result["overlap"]
    assert (overlap["rows"], overlap["half"], overlap["context"]) == (6, 3, 20)
    assert overlap["halves_max_abs_diff"] < 1e-4  # two half-batches compute what the whole batch does
    assert min(overlap["whole_ms"], overlap["halves_ms"], overlap["two_streams_ms"]) > 0

    (projections,) = result["projections"]
    assert projections["rows"] == 5 and projections["layers"] == 4
    assert projections["separate_ms"] > 0 and projections["fused_ms"] > 0

    est = result["recipe_estimate"]
    for key in ("regen_engine_h", "regen_old_hf_batch32_h", "extract_h", "train_h", "total_engine_h"):
        assert est[key] > 0
    assert returned["workload"] == result["workload"]


def test_draw_lengths_hits_the_mean_within_the_range() -> None:
    import numpy as np

    lengths = draw_lengths(np.random.default_rng(0), 2000, 64, 1024, 300, 0.7)
    assert lengths.min() >= 64 and lengths.max() <= 1024
    assert abs(lengths.mean() - 300) < 1


def test_bench_regenerate_chat_runs_real_conversations_with_and_without_reuse(tiny_target_dir, tmp_path: Path) -> None:
    """`--chat`: the first records of a conversation file through regenerate_records twice; with reuse
    the later turns' prompts come partly from the cache, and the conversations come out the same."""
    sample = Path(__file__).parents[1] / "data" / "sample" / "conversations.jsonl"
    multi = [line for line in sample.read_text().splitlines() if line.count('"assistant"') + line.count('"gpt"') > 1]
    chat = tmp_path / "multi.jsonl"
    chat.write_text("\n".join(multi[:5]) + "\n")
    args = ["--device", "cpu", "--target", str(tiny_target_dir), "--chat", str(chat), "--requests", "5"]
    args += ["--max-reply", "6", "--batch", "3", "--reuse-prefixes", "on", "--reuse-prefixes", "off"]
    result = main([*args, "--json", str(tmp_path / "chat.json")])
    on, off = result["rows"]
    assert (on["reuse_prefixes"], off["reuse_prefixes"]) == (True, False)
    assert on["replies"] == off["replies"] > 5 and on["generated_tokens"] == off["generated_tokens"]
    assert on["cached_tokens"] > 0 and off["cached_tokens"] == 0
    assert on["prefilled_tokens"] + on["cached_tokens"] == off["prefilled_tokens"]
    assert off["identical_to_first_row"] == 5
    assert json.loads((tmp_path / "chat.json").read_text())["records"] == 5


def test_bench_regenerate_chat_scores_lossless_and_fp8_replies(tiny_target_dir, tmp_path: Path) -> None:
    """`--chat --score-replies` with both KV caches: every row's replies scored, the fp8 row's
    compared with the lossless row's, reply by reply."""
    sample = Path(__file__).parents[1] / "data" / "sample" / "conversations.jsonl"
    args = ["--device", "cpu", "--target", str(tiny_target_dir), "--chat", str(sample), "--requests", "4"]
    args += ["--max-reply", "8", "--batch", "3", "--kv-cache-dtype", "auto", "--kv-cache-dtype", "float8_e4m3fn"]
    lossless, fp8 = main([*args, "--score-replies"])["rows"]
    assert (lossless["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "float8_e4m3fn")
    assert lossless["scores"]["reply_tokens"] >= lossless["replies"] * 4
    assert "vs_first_row" not in lossless
    vs = fp8["vs_first_row"]
    # fp8 rounding changes some greedy replies of the tiny random target (near-tied logits)
    assert vs["replies"] == lossless["replies"] and vs["identical_replies"] < vs["replies"]
    for row in (lossless, fp8):
        assert 0 < row["scores"]["argmax_agreement"] <= 1 and row["scores"]["mean_nll"] > 0


def test_reply_scores_equal_the_target_run_on_each_prefix(tiny_target_dir) -> None:
    """score_replies teacher-forces whole conversations; the same counts from the target run on each
    reply token's prefix alone, one at a time (the loss mask as extraction makes it)."""
    from transformers import AutoModelForCausalLM

    from bench.reply_scoring import score_replies
    from dflash_pipeline.data.records import Record
    from dflash_pipeline.data.tokens import tokenize_record
    from dflash_pipeline.shared.target.assets import load_tokenizer

    tokenizer = load_tokenizer(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    user = {"role": "user", "content": "what is two plus two"}
    conversations = [
        [user, {"role": "assistant", "content": "four"}],
        [user, {"role": "assistant", "content": "four cats"}, user, {"role": "assistant", "content": "five"}],
    ]
    tokens = agree = 0
    nll = 0.0
    with torch.no_grad():
        for i, messages in enumerate(conversations):
            sample = tokenize_record(Record(i, "t", messages=messages), tokenizer, 256)
            for t in map(int, sample.loss_mask.nonzero()[0]):
                logits = model(torch.as_tensor(sample.input_ids[None, :t], dtype=torch.long)).logits[0, -1]
                label = int(sample.input_ids[t])
                tokens, agree = tokens + 1, agree + int(logits.argmax() == label)
                nll -= float(torch.log_softmax(logits, -1)[label])
    scores = score_replies(model, tokenizer, conversations, 256)
    assert scores["reply_tokens"] == tokens > 6 and scores["argmax_agreement"] == agree / tokens
    assert scores["mean_nll"] == pytest.approx(nll / tokens, rel=1e-5)


def test_reply_divergence_pairs_replies_and_counts_the_common_prefix(tiny_target_dir) -> None:
    """Two conversations regenerated two ways: one reply identical, one changed from its first token;
    the common prefix is counted in tokens over the shorter of each pair. An assistant turn opening a
    conversation was never regenerated and is not counted."""
    from bench.reply_scoring import reply_divergence
    from dflash_pipeline.shared.target.assets import load_tokenizer

    tokenizer = load_tokenizer(tiny_target_dir)
    user = {"role": "user", "content": "what is two plus two"}
    opening = {"role": "assistant", "content": "hello"}
    first = [
        [user, {"role": "assistant", "content": "it is four"}],
        [opening, user, {"role": "assistant", "content": "four"}],
    ]
    other = [first[0], [opening, user, {"role": "assistant", "content": "two cats"}]]
    ids = {t: tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("it is four", "four", "two cats")}
    assert ids["four"][0] != ids["two cats"][0]
    common = len(ids["it is four"]) + 0
    compared = len(ids["it is four"]) + min(len(ids["four"]), len(ids["two cats"]))
    vs = reply_divergence(first, other, tokenizer)
    assert vs == {"replies": 2, "identical_replies": 1, "common_prefix_fraction": common / compared}


def test_bench_regenerate_rows_per_kv_cache_dtype() -> None:
    """`--kv-cache-dtype auto --kv-cache-dtype float8_e4m3fn`: one engine row and one decode profile
    each; the fp8 row's bound counts a quarter of the float32 model's KV bytes (one byte an element),
    and the recipe estimate takes the lossless row."""
    from bench.regenerate import bound_tok_s

    args = ["--device", "cpu", "--shape", "tiny", "--requests", "6", "--max-prompt", "24", "--max-reply", "12"]
    args += ["--batch", "4", "--skip-baseline", "--kv-cache-dtype", "auto", "--kv-cache-dtype", "float8_e4m3fn"]
    result = main([*args, "--profile-decode", "3", "--profile-decode-context", "20"])
    lossless, fp8 = result["engine"]
    assert (lossless["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("float32", "float8_e4m3fn")
    quarter = {**result, "kv_bytes_per_token": result["kv_bytes_per_token"] // 4}
    bandwidth = result["copy_bandwidth_GBps"] * 1e9
    assert fp8["bound_tok_s"] == pytest.approx(bound_tok_s(4, fp8["mean_context"], quarter, bandwidth))
    assert lossless["bound_tok_s"] == pytest.approx(bound_tok_s(4, lossless["mean_context"], result, bandwidth))
    assert result["recipe_estimate"]["regen_engine_tok_s_per_gpu"] == lossless["tokens_per_s"]
    assert [d["kv_cache_dtype"] for d in result["decode_profile"]] == ["float32", "float8_e4m3fn"]


def test_bench_regenerate_replays_the_engines_schedule_without_computing() -> None:
    """`--replay-pages`: the schedule alone; reuse moves prompt tokens from prefill to the cache
    without changing the decode steps, and waiting to admit prefills fewer, larger batches."""
    args = ["--device", "cpu", "--shape", "tiny", "--requests", "20", "--turns", "3", "--max-prompt", "64"]
    args += ["--max-reply", "48", "--batch", "128", "--replay-pages", "400", "--reuse-prefixes", "on"]
    args += ["--reuse-prefixes", "off", "--admit-wait-steps", "0", "--admit-wait-steps", "8", "--replay-cost"]
    rows = {(r["reuse_prefixes"], r["admit_wait_steps"]): r for r in main(args)["rows"]}
    assert len(rows) == 4 and all(r["cost"]["tok_s"] > 0 for r in rows.values())
    on, off = rows[True, 0], rows[False, 0]
    assert on["prefill_tokens"] + on["reused_prompt_tokens"] == off["prefill_tokens"] and on["reused_prompt_tokens"] > 0
    assert on["decode_steps"] == off["decode_steps"]
    assert rows[True, 8]["prefills"] < on["prefills"] and rows[False, 8]["prefills"] < off["prefills"]


def test_bench_regenerate_profiles_a_prefill_of_continued_prompts() -> None:
    args = ["--device", "cpu", "--shape", "tiny", "--requests", "3", "--turns", "2", "--max-prompt", "24"]
    args += ["--max-reply", "8", "--batch", "4", "--skip-baseline", "--profile-prefill", "3"]
    profiled = main(args)["prefill_profile"]
    assert profiled["continued"] and profiled["prompts"] == 3
    assert 0 < profiled["prefilled_tokens"] < profiled["prompt_tokens"]  # the first turns' tokens come from the cache
    assert profiled["by_host_time"]


def test_schedule_cost_charges_each_step_its_padded_rows_and_kv_reads() -> None:
    """`--replay-cost`: a step's matmul counts its rows padded to the graph bucket, is never cheaper
    than reading the weights once, and adds its KV reads; prefill is charged per prompt token, and
    each prefill's prompts yield one generated token each."""
    import argparse

    from bench.regenerate import qwen3_8b_shape_bytes, schedule_cost

    sizes = qwen3_8b_shape_bytes()
    weights, kv = sizes["weight_bytes_read_per_step"], sizes["kv_bytes_per_token"]
    args = argparse.Namespace(
        cost_bandwidth=4e12, cost_peak_flops=800e12, cost_step_efficiency=0.5, cost_prefill_tok_s=40_000
    )
    steps = [(3, 3_000), (100, 60_000), (200, 120_000)]  # buckets of 4, 128 and 256 rows (step 64, batch 256)
    for kv_cache_dtype, kv_bytes in ((None, kv), ("float8_e4m3fn", kv // 2)):  # fp8: half the KV bytes
        cost = schedule_cost(steps, [(8_000, 5)], batch=256, bucket_step=64, kv_cache_dtype=kv_cache_dtype, args=args)
        # up to ~200 rows the weight read outlasts the matmul (2 FLOPs per 2-byte weight per row)
        expected = weights / 4e12 + 3_000 * kv_bytes / 4e12
        expected += weights / 4e12 + 60_000 * kv_bytes / 4e12
        expected += weights * 256 / 800e12 + 120_000 * kv_bytes / 4e12
        assert cost["decode_roofline_s"] == pytest.approx(expected)
        assert cost["decode_s"] == pytest.approx(2 * expected) and cost["prefill_s"] == pytest.approx(0.2)
        assert cost["tok_s"] == pytest.approx((303 + 5) / (2 * expected + 0.2))
