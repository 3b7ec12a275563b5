"""What a user can get wrong ends in one line naming the path, a non-zero exit and no traceback;
`--debug` brings the traceback back. Wrong pairings of store, drafter and target are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_train import TRAIN_ARGS as TINY_DRAFTER_ARGS
from test_train import base_config

from dflash_pipeline.extract.cli import main as extract_main
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import run_extraction
from dflash_pipeline.shared.target.identity import IDENTITY_FILE
from dflash_pipeline.train.cli import main as train_main
from dflash_pipeline.train.config import TrainConfig
from dflash_pipeline.train.eval_cli import main as eval_main
from dflash_pipeline.train.run import run_training

TRAIN_ARGS = [*TINY_DRAFTER_ARGS, "--max-steps", "1"]


@pytest.fixture(scope="module")
def drafter(store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    run_training(base_config(store, out, max_steps=1))
    return out / "drafter"


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """The tiny target's architecture and config with other random weights."""
    from dflash_pipeline.data.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("other_weights"), arch="qwen3", seed=1)


@pytest.fixture(scope="module")
def shallow_target(tmp_path_factory) -> Path:
    """A 2-layer target: the drafter's layer ids do not exist in it."""
    from dflash_pipeline.data.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("shallow"), arch="qwen3", num_layers=2)


def fails(main, args: list[str], *named: str, code: int = 1) -> str:
    """Run a CLI that must fail with one `error:` line (no traceback) naming each of `named`."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.stderr.splitlines() if "error:" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for text in named:
        assert str(text) in errors[0], (text, errors[0])
    return errors[0]


def eval_args(target: Path, drafter: Path, prompts: Path) -> list[str]:
    return [
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--prompts",
        str(prompts),
        "--device",
        "cpu",
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
    ]


def test_missing_data_file_is_one_line_and_writes_nothing(tiny_target_dir, tmp_path):
    out = tmp_path / "store"
    fails(
        extract_main,
        [
            "--target",
            str(tiny_target_dir),
            "--data",
            str(tmp_path / "nope.jsonl"),
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
        "nope.jsonl",
        "no such file",
    )
    assert not out.exists()


@pytest.mark.parametrize("stage", ["extract", "train", "eval"])
def test_a_target_that_is_no_folder_is_refused_at_once(stage, store, drafter, small_corpus, tmp_path, monkeypatch):
    """A typo in --target: transformers would take the name for a Hub repository and retry downloads
    for half a minute (no network here) before an error about huggingface.co."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    typo = tmp_path / "Qwen3-8b"
    main, args = {
        "extract": (extract_main, ["--data", str(small_corpus), "--out", str(tmp_path / "s"), "--device", "cpu"]),
        "train": (train_main, ["--store", str(store), "--out", str(tmp_path / "run"), *TINY_DRAFTER_ARGS]),
        "eval": (eval_main, eval_args(typo, drafter, small_corpus)[2:]),
    }[stage]
    line = fails(main, ["--target", str(typo), *args], f"{typo}: no such folder; --target is the target model's")
    assert "huggingface" not in line


def test_target_without_tokenizer_files_says_so(tiny_target_dir, small_corpus, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_target_dir / name, bare / name)
    fails(
        extract_main,
        ["--target", str(bare), "--data", str(small_corpus), "--out", str(tmp_path / "s"), "--device", "cpu"],
        str(bare),
        "no tokenizer files",
    )


def test_missing_store_and_truncated_manifest(store, tmp_path):
    fails(
        train_main,
        ["--store", str(tmp_path / "nostore"), "--out", str(tmp_path / "r"), *TRAIN_ARGS],
        "nostore",
        "manifest.json",
    )
    cut = tmp_path / "cut"
    shutil.copytree(store, cut)
    manifest = cut / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    fails(train_main, ["--store", str(cut), "--out", str(tmp_path / "r"), *TRAIN_ARGS], str(manifest), "corrupt")


def test_corrupt_shard_read_by_a_loader_worker_is_one_line(store, tmp_path):
    """Through a DataLoader worker process, as training reads by default: the worker's error
    reaches the user as its own line, the workers are stopped (no leaked semaphores) and no empty
    metrics file is left behind."""
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    chunk = next(p for p in sorted((bad / "shards").rglob("*")) if p.is_file() and "hidden_states/c" in p.as_posix())
    data = bytearray(chunk.read_bytes())
    data[64] ^= 0xFF
    chunk.write_bytes(bytes(data))
    run = tmp_path / "run"
    args = list(TRAIN_ARGS)
    args[args.index("--loader-workers") + 1] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.train.cli", "--store", str(bad), "--out", str(run), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("dflash-train: error: "), proc.stderr[-2000:]
    assert str(chunk) in errors[0] and "crc32c" in errors[0]
    assert "Traceback" not in proc.stderr and "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
    assert not (run / "metrics.jsonl").exists()


def test_missing_drafter(tiny_target_dir, small_corpus, tmp_path):
    fails(
        eval_main,
        eval_args(tiny_target_dir, tmp_path / "nodrafter", small_corpus),
        "nodrafter",
        "no such drafter folder",
    )
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    fails(eval_main, eval_args(tiny_target_dir, half, small_corpus), str(half / "model.safetensors"), "missing")


def test_a_training_run_given_as_the_drafter_is_refused_naming_the_drafter_to_pass(
    tiny_target_dir, small_corpus, drafter, tmp_path
):
    run = drafter.parent
    fails(eval_main, eval_args(tiny_target_dir, run, small_corpus), f"{run}: a dflash-train run", f"{drafter}")
    stopped = tmp_path / "stopped"  # a run cut short: checkpoints, no final drafter yet
    shutil.copytree(run, stopped)
    shutil.rmtree(stopped / "drafter")
    checkpoint = stopped / "checkpoints" / "step-00000001"
    fails(eval_main, eval_args(tiny_target_dir, stopped, small_corpus), f"its latest checkpoint, {checkpoint}")


def test_prompts_without_one_usable_prompt_are_refused_saying_what_was_read(tiny_target_dir, drafter, tmp_path):
    """A prompts file of the wrong kind (say a store's folder, or records without a prompt) is named
    with what was read and the first bad record's own message, not a bare usage error."""
    prompts = tmp_path / "prompts.jsonl"
    reply_only = {"messages": [{"role": "assistant", "content": "Hello"}]}
    prompts.write_text(json.dumps({"question": "Why?"}) + "\n" + json.dumps(reply_only) + "\n")
    fails(
        eval_main,
        eval_args(tiny_target_dir, drafter, prompts),
        f"{prompts}: no usable prompts (1 files; 1 records; 1 skipped (no_content_field=1); 1 open with a reply",
        f"the first skipped: {prompts}:1: record has none of 'messages', 'conversations', 'text', 'prompt')",
    )


def test_trained_drafter_records_its_target(drafter, store):
    recorded = json.loads((drafter / IDENTITY_FILE).read_text())
    manifest = json.loads((store / "manifest.json").read_text())
    assert recorded["config_hash"] == manifest["target"]["config_hash"]
    assert recorded["weights_fingerprint"] == manifest["target"]["weights_fingerprint"]


def test_eval_refuses_a_target_with_other_weights(drafter, other_weights, small_corpus):
    line = fails(
        eval_main, eval_args(other_weights, drafter, small_corpus), str(other_weights), str(drafter), "other weights"
    )
    assert "weights fingerprint" in line


def test_eval_refuses_another_architecture_with_or_without_a_recorded_identity(
    drafter, shallow_target, tiny_llama_dir, small_corpus, tmp_path
):
    fails(eval_main, eval_args(tiny_llama_dir, drafter, small_corpus), str(tiny_llama_dir), "config hash")
    fails(eval_main, eval_args(shallow_target, drafter, small_corpus), str(shallow_target), "config hash")
    anonymous = tmp_path / "anonymous"  # a drafter from elsewhere: only its shape can be checked
    shutil.copytree(drafter, anonymous)
    (anonymous / IDENTITY_FILE).unlink()
    fails(eval_main, eval_args(shallow_target, anonymous, small_corpus), str(anonymous), "the target has 2")


def test_eval_accepts_its_own_target(drafter, tiny_target_dir, small_corpus, tmp_path):
    result = CliRunner().invoke(eval_main, [*eval_args(tiny_target_dir, drafter, small_corpus), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout[result.stdout.index("{") :])["all_lossless"] is True


def test_train_refuses_a_store_of_another_target(store, other_weights, tiny_llama_dir, tmp_path):
    for target, why in ((other_weights, "other weights"), (tiny_llama_dir, "config hash")):
        fails(
            train_main,
            ["--store", str(store), "--out", str(tmp_path / "r"), "--target", str(target), *TRAIN_ARGS],
            str(target),
            str(store),
            why,
        )
    assert not (tmp_path / "r").exists()


def test_debug_shows_the_traceback(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_DEBUG", "0")  # restored afterwards: --debug sets it for worker processes
    result = CliRunner().invoke(
        extract_main,
        [
            "--target",
            str(tiny_target_dir),
            "--data",
            str(tmp_path / "nope.jsonl"),
            "--out",
            str(tmp_path / "s"),
            "--device",
            "cpu",
            "--debug",
        ],
    )
    assert result.exit_code == 1
    assert type(result.exception).__name__ == "DataError" and "nope.jsonl" in str(result.exception)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_library_callers_asking_for_cuda_are_refused_not_moved_to_the_cpu(
    store, tiny_target_dir, small_corpus, tmp_path
):
    from dflash_pipeline.shared.runtime.device import DeviceUnavailable

    with pytest.raises(DeviceUnavailable, match="device cuda: no CUDA device"):
        run_training(TrainConfig(store=str(store), out=str(tmp_path / "run"), device="cuda"))
    with pytest.raises(DeviceUnavailable, match="device cuda: no CUDA device"):
        run_extraction(
            ExtractConfig(
                target=str(tiny_target_dir), data=(str(small_corpus),), out=str(tmp_path / "s"), device="cuda"
            )
        )
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()


def test_more_held_out_samples_than_the_store_has_is_one_line(store, tmp_path):
    samples = json.loads((store / "manifest.json").read_text())["data"]["counts"]["samples"]
    args = ["--store", str(store), "--out", str(tmp_path / "r"), *TRAIN_ARGS, "--eval-samples", str(samples)]
    fails(train_main, args, f"--eval-samples {samples}", f"the store has {samples}")


def test_torchrun_agents_read_why_a_worker_ended(tmp_path, monkeypatch):
    """Under torchrun a CLI also writes why it ends (its error line, a bug's traceback) where the agent
    reads it: torchrun's own failure summary, parsed here by torch's reader, shows it."""
    import click
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dflash_pipeline.shared.runtime.errors import UserError, cli_errors

    def command(exc: Exception):
        @click.command()
        @cli_errors("dflash-x")
        def main() -> None:
            raise exc

        return main

    def summary(exc: Exception) -> str:
        error_file = tmp_path / f"{type(exc).__name__}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        CliRunner().invoke(command(exc), [])
        return ChildFailedError("dflash-x", {0: ProcessFailure(0, 1, 1, str(error_file))}).format_msg()

    assert "traceback : dflash-x: error: data.jsonl:3: no reply" in summary(UserError("data.jsonl:3: no reply"))
    bug = summary(ZeroDivisionError("division by zero"))
    assert "Traceback (most recent call last)" in bug and "ZeroDivisionError: division by zero" in bug
