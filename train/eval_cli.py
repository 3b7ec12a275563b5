"""`dflash-eval`: real speculative decoding with a trained drafter against target-only decoding.

For every prompt both decoders run greedily in the same process, one after the other; the output of
the speculative run must equal the target's own (lossless) and is checked. Reports the mean
acceptance length tau (tokens per target forward) and the wall-clock speedup, as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch


def prompts_from(path: str, tokenizer, limit: int, max_prompt_tokens: int) -> list[list[int]]:
    """Chat prompts: the messages before the first assistant turn, with the generation prompt."""
    from dflash_pipeline.data.records import iter_records

    prompts: list[list[int]] = []
    for record in iter_records(path, skip_bad=True):
        if len(prompts) >= limit:
            break
        if record.messages:
            head = []
            for m in record.messages:
                if m["role"] == "assistant":
                    break
                head.append(m)
            if not head:
                continue
            ids = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(record.text)["input_ids"]
        prompts.append(list(ids)[-max_prompt_tokens:])
    return prompts


def evaluate(target_path: str, drafter_path: str, prompts_path: str, *, limit: int, max_new_tokens: int,
             device: str, dtype: str, block_size: int | None, max_prompt_tokens: int = 1024) -> dict:
    from dflash_pipeline.data.chat import stop_token_ids
    from dflash_pipeline.extract.assets import load_tokenizer
    from dflash_pipeline.extract.target import HiddenStateCapture, load_full_target
    from dflash_pipeline.shared.drafter import DFlashDrafter
    from dflash_pipeline.shared.speculative import dflash_generate, target_greedy

    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    target = load_full_target(target_path, device=dev, dtype=torch_dtype)
    drafter = DFlashDrafter.from_pretrained(drafter_path, attention_backend="sdpa_dense", device=dev, dtype=torch_dtype).eval()
    tokenizer = load_tokenizer(target_path)
    stop_ids = stop_token_ids(tokenizer, target.generation_config.eos_token_id)
    capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
    prompts = prompts_from(prompts_path, tokenizer, limit, max_prompt_tokens)
    if not prompts:
        raise click.UsageError(f"{prompts_path}: no usable prompts")
    # one warm-up of each path so the first measured prompt does not pay for lazy initialisation
    warm = torch.tensor(prompts[0], device=dev)
    target_greedy(target, warm, 4, stop_ids)
    dflash_generate(target, drafter, capture, warm, 4, stop_ids, block_size)
    rows = []
    for ids in prompts:
        p = torch.tensor(ids, device=dev)
        base = target_greedy(target, p, max_new_tokens, stop_ids)
        spec = dflash_generate(target, drafter, capture, p, max_new_tokens, stop_ids, block_size)
        rows.append({"prompt_tokens": len(ids), "new_tokens": len(spec.tokens), "tau": spec.tau,
                     "lossless": spec.tokens == base.tokens, "target_s": base.seconds, "dflash_s": spec.seconds,
                     "accepted": spec.accepted})
    capture.close()
    steps = sum(len(r["accepted"]) for r in rows)
    return {
        "target": target_path, "drafter": drafter_path, "prompts": prompts_path, "num_prompts": len(rows),
        "max_new_tokens": max_new_tokens, "block_size": block_size or drafter.config.block_size,
        "device": str(dev), "dtype": str(torch_dtype).removeprefix("torch."),
        "tau": sum(sum(r["accepted"]) for r in rows) / steps if steps else float("nan"),
        "speedup": sum(r["target_s"] for r in rows) / sum(r["dflash_s"] for r in rows),
        "all_lossless": all(r["lossless"] for r in rows),
        "per_prompt": rows,
    }


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--target", required=True, help="The target model folder (as given to dflash-extract).")
@click.option("--drafter", required=True, help="A trained drafter folder (dflash-train's OUT/drafter).")
@click.option("--prompts", required=True, help="Prompt records (same formats as --data of dflash-extract).")
@click.option("--limit", default=16, type=click.IntRange(1), help="Number of prompts.")
@click.option("--max-new-tokens", default=128, type=click.IntRange(1))
@click.option("--block-size", default=None, type=click.IntRange(2), help="[default: the drafter's]")
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto")
@click.option("--json", "json_path", default=None, help="Write the full report here.")
def main(target, drafter, prompts, limit, max_new_tokens, block_size, device, dtype, json_path) -> None:
    """Measure acceptance length and speedup of a drafter; check lossless greedy decoding."""
    report = evaluate(target, drafter, prompts, limit=limit, max_new_tokens=max_new_tokens, device=device,
                      dtype=dtype, block_size=block_size)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    click.echo(json.dumps({k: v for k, v in report.items() if k != "per_prompt"}, indent=1))
    if not report["all_lossless"]:
        click.echo("dflash-eval: error: speculative output differs from target greedy output", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
