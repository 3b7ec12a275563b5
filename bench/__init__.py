"""Benchmarks: each prints ratios against a baseline measured in the same run (see RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, json_path: str | None) -> None:
    """Print a benchmark's result as JSON and, if asked, write the same text to `json_path`."""
    print(json.dumps(result, indent=1))
    keep(result, json_path)


def keep(result: dict, json_path: str | None) -> None:
    """`result` as JSON in `json_path`, if asked; also what a long benchmark has measured so far, so a call
    cut by the lent machine's limit still returns it (`emit` rewrites it whole at the end)."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))


def report_prompts(report: dict, prompts_file: str, tokenizer, target: str) -> list[list[int]]:
    """The prompt tokens of each row of a `dflash-eval` report, read again from its prompts file: by the
    row's `prompt_index` (a shard's rows are not the first prompts), by position in reports without it.
    ValueError naming the first prompt that is missing or whose token count is not the report's."""
    from dflash_pipeline.train.eval_cli import EvalConfig, prompts_from

    rows = report["per_prompt"]
    planned = report.get("prompts_planned", len(rows))
    prompts = prompts_from(prompts_file, tokenizer, planned, EvalConfig.max_prompt_tokens)
    picked = []
    for position, row in enumerate(rows):
        i = row.get("prompt_index", position)
        if i >= len(prompts):
            raise ValueError(f"{prompts_file} has {len(prompts)} prompts, the drafter report's prompt {i} is not one")
        if len(prompts[i]) != row["prompt_tokens"]:
            raise ValueError(
                f"prompt {i}: {len(prompts[i])} tokens with {target}'s tokenizer, {row['prompt_tokens']} in the "
                "drafter report (another tokenizer or prompts file?)"
            )
        picked.append(prompts[i])
    return picked
