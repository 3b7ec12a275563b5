"""The CLI options of every command derive from its config dataclass: every field
is an option with the field's default, and the dataclass itself refuses what the CLI refuses."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from dflash_pipeline.extract.cli import main as extract_main
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.regenerate import RegenerateSettings
from dflash_pipeline.shared.runtime.config import ConfigError, config_from_cli
from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.train.cli import main as train_main
from dflash_pipeline.train.config import TrainConfig

EXTRACT_REQUIRED = {"target": "t", "data": ("d.jsonl",), "out": "o"}
TRAIN_REQUIRED = {"store": "s", "out": "o"}


def parsed(main, args: list[str]) -> dict:
    """The options click hands the command (nothing runs)."""
    params = main.make_context(main.name, args).params
    params.pop("debug")
    return params


def names(*classes) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(
    "main, cls, required, args, extra",
    [
        (extract_main, ExtractConfig, EXTRACT_REQUIRED, ["--target", "t", "--data", "d.jsonl", "--out", "o"], {}),
        (
            extract_main,
            ExtractConfig,
            EXTRACT_REQUIRED,
            ["--target", "t", "--data", "d.jsonl", "--out", "o", "--regenerate"],
            {"regenerate": RegenerateSettings().to_dict()},
        ),
        (train_main, TrainConfig, TRAIN_REQUIRED, ["--store", "s", "--out", "o"], {}),
    ],
)
def test_every_field_is_an_option_with_the_fields_default(main, cls, required, args, extra):
    params = parsed(main, args)
    settings = (RegenerateSettings,) if cls is ExtractConfig else ()
    assert set(params) == names(cls, *settings)
    assert config_from_cli(cls, params) == cls(**required, **extra)


def test_options_parse_into_the_fields_types():
    params = parsed(
        extract_main,
        [
            "--target",
            "t",
            "--data",
            "a",
            "--data",
            "b",
            "--out",
            "o",
            "--gpus",
            "0,1,2",
            "--chat-template-kwargs",
            '{"enable_thinking": false}',
            "--no-compile",
        ],
    )
    cfg = config_from_cli(ExtractConfig, params)
    assert (cfg.data, cfg.gpus, cfg.chat_template_kwargs, cfg.compile) == (
        ("a", "b"),
        (0, 1, 2),
        {"enable_thinking": False},
        False,
    )


@pytest.mark.parametrize(
    "flag, given, on_gpu, on_cpu",
    [
        ([], None, True, False),
        (["--compile-drafter"], True, True, True),
        (["--no-compile-drafter"], False, False, False),
    ],
)
def test_the_drafter_compiles_on_a_gpu_unless_told(flag, given, on_gpu, on_cpu):
    """`dflash-train` compiles the drafter by default where that halves its step (a GPU), not on a CPU;
    either flag overrides the default."""
    cfg = config_from_cli(TrainConfig, parsed(train_main, ["--store", "s", "--out", "o", *flag]))
    assert cfg.compile_drafter is given
    assert (cfg.compiles_drafter("cuda"), cfg.compiles_drafter("cpu")) == (on_gpu, on_cpu)


@pytest.mark.parametrize(
    "make, option",
    [
        (lambda: TrainConfig(**TRAIN_REQUIRED, pack_tokens=200), "--pack-tokens"),
        (lambda: TrainConfig(**TRAIN_REQUIRED, num_blocks=3), "--num-blocks x --block-size"),
        (lambda: TrainConfig(**TRAIN_REQUIRED, epochs=0), "--epochs"),
        (lambda: TrainConfig(**TRAIN_REQUIRED, attention="flash"), "--attention"),
        (lambda: ExtractConfig(**EXTRACT_REQUIRED, store_dtype="int8"), "--store-dtype"),
        (lambda: ExtractConfig(**EXTRACT_REQUIRED, chunk_tokens=3, shard_tokens=10), "--shard-tokens"),
        (lambda: RegenerateSettings(top_p=0.0), "--top-p"),
        (lambda: RegenerateSettings(samples_per_prompt=2), "--samples-per-prompt > 1 needs --temperature > 0"),
    ],
)
def test_the_dataclass_refuses_a_bad_value_naming_the_option(make, option):
    with pytest.raises(ConfigError, match=option) as caught:
        make()
    assert isinstance(caught.value, UserError)


@pytest.mark.parametrize(
    "main, args, option",
    [
        (train_main, ["--store", "s", "--out", "o", "--pack-tokens", "200"], "--pack-tokens"),
        (
            extract_main,
            ["--target", "t", "--data", "d", "--out", "o", "--samples-per-prompt", "2"],
            "--samples-per-prompt",
        ),
        (
            extract_main,
            ["--target", "t", "--data", "d", "--out", "o", "--chunk-tokens", "3", "--shard-tokens", "10"],
            "--shard-tokens",
        ),
    ],
)
def test_the_cli_turns_a_refused_config_into_a_usage_error(monkeypatch, main, args, option):
    import dflash_pipeline.extract.run as extract_run
    import dflash_pipeline.train.run as train_run

    ran = []
    monkeypatch.setattr(extract_run, "run_extraction", ran.append)
    monkeypatch.setattr(train_run, "run_training", ran.append)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert option in result.output and not ran


def test_dflash_eval_options_are_its_config_fields_with_their_defaults():
    from dflash_pipeline.train.eval_cli import EvalConfig
    from dflash_pipeline.train.eval_cli import main as eval_main

    required = {"target": "t", "drafter": "d", "prompts": "p.jsonl"}
    params = parsed(eval_main, ["--target", "t", "--drafter", "d", "--prompts", "p.jsonl"])
    assert set(params) == {f.name for f in dataclasses.fields(EvalConfig) if "cli" in f.metadata}
    assert config_from_cli(EvalConfig, params) == EvalConfig(**required)
    with pytest.raises(ConfigError, match="--top-p"):
        EvalConfig(**required, top_p=0.0)
    result = CliRunner().invoke(eval_main, [*sum((["--" + k, v] for k, v in required.items()), []), "--limit", "0"])
    assert result.exit_code == 2 and "--limit" in result.output
