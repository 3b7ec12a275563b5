"""`--config` TOML defaults with flags winning, and the `dflash-report` PNG."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner


def captured_train_config(monkeypatch, tmp_path, args):
    import dflash_pipeline.train.run as run_module
    from dflash_pipeline.train.cli import main

    seen = {}
    monkeypatch.setattr(run_module, "run_training", lambda cfg: seen.setdefault("cfg", cfg) and None)
    result = CliRunner().invoke(main, args)
    return result, seen.get("cfg")


def test_config_file_sets_defaults_and_flags_override_it(monkeypatch, tmp_path):
    (tmp_path / "store").mkdir()
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nnum-layers = 3\nblock_size = 4\nlr = 1e-4\n[extract]\nlayers = "1,2"\n')
    result, cfg = captured_train_config(
        monkeypatch,
        tmp_path,
        [
            "--config",
            str(toml),
            "--store",
            str(tmp_path / "store"),
            "--out",
            str(tmp_path / "o"),
            "--device",
            "cpu",
            "--block-size",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (cfg.num_layers, cfg.block_size, cfg.lr) == (3, 8, 1e-4)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[train]\nnum_layer = 3\n", "unknown keys in [train]: num_layer"),
        ("[train\n", "not valid TOML"),
    ],
)
def test_bad_config_file_is_a_clear_error(monkeypatch, tmp_path, text, message):
    (tmp_path / "store").mkdir()
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    result, cfg = captured_train_config(
        monkeypatch,
        tmp_path,
        ["--config", str(toml), "--store", str(tmp_path / "store"), "--out", str(tmp_path / "o"), "--device", "cpu"],
    )
    assert result.exit_code != 0 and cfg is None
    assert message in result.output and "run.toml" in result.output


def test_report_draws_a_png_of_loss_and_tau(tmp_path):
    from dflash_pipeline.train.report import main

    rows = [{"step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 21)] + [
        {"step": 10, "type": "eval", "tau": 1.5},
        {"step": 20, "type": "eval", "tau": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code == 0, result.output
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_draws_dflash2_loss_terms_beside_the_loss(tmp_path, monkeypatch):
    """A DFlash-2 run's CE and selector terms, in training and held out, are curves of the loss panel;
    a DFlash run's loss panel is its loss alone."""
    from matplotlib.axes import Axes

    from dflash_pipeline.train import report

    rows = [{"step": s, "loss": 9.0 / s, "ce_loss": 6.0 / s, "selector_loss": 3.0 / s} for s in range(1, 11)]
    evals = [
        {"step": 10, "type": "eval", "tau": 1.5, "tau_decode": 1.4, "tau_decode_head": 1.3}
        | {"ce_loss": 0.7, "selector_loss": 0.4}
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + evals))
    drawn = {}
    real_plot = Axes.plot

    def plot(ax, x, y, *args, label=None, **kwargs):
        drawn[label] = (list(x), list(y))
        return real_plot(ax, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    result = CliRunner().invoke(report.main, ["--run", str(tmp_path)])
    assert result.exit_code == 0, result.output
    steps = list(range(1, 11))
    assert drawn == {
        "loss": (steps, [r["loss"] for r in rows]),
        "ce_loss": (steps, [r["ce_loss"] for r in rows]),
        "held-out ce_loss": ([10], [0.7]),
        "selector_loss": (steps, [r["selector_loss"] for r in rows]),
        "held-out selector_loss": ([10], [0.4]),
        "drawn anchors (tau)": ([10], [1.5]),  # the tau panel
        "decoding chain (tau_decode)": ([10], [1.4]),
        "chain, first tokens of each reply (tau_decode_head)": ([10], [1.3]),
    }
    plain = [{k: v for k, v in r.items() if k not in ("ce_loss", "selector_loss")} for r in rows]
    assert report.loss_curves(plain, [{"step": 10, "type": "eval", "tau": 1.5}]) == {
        "loss": (steps, [r["loss"] for r in rows])
    }


def test_report_without_metrics_is_a_clear_error(tmp_path):
    from dflash_pipeline.train.report import main

    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code != 0 and "metrics.jsonl: no metrics" in result.output


@pytest.mark.parametrize("text", ["", "\n", json.dumps({"step": 10, "type": "eval", "tau": 1.5}) + "\n"])
def test_report_of_a_metrics_file_without_loss_rows_is_one_line(tmp_path, text):
    from dflash_pipeline.train.report import main

    (tmp_path / "metrics.jsonl").write_text(text)
    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)  # a usage error, no traceback
    assert "metrics.jsonl: no training loss rows" in result.output
    assert not (tmp_path / "report.png").exists()


def test_report_accepts_dash_h():
    from dflash_pipeline.train.report import main

    result = CliRunner().invoke(main, ["-h"])
    assert result.exit_code == 0 and "--run" in result.output


LOSS_ROWS = "".join(json.dumps({"step": s, "loss": 5.0 / s}) + "\n" for s in range(1, 4))


@pytest.mark.parametrize(
    "text, line, what",
    [
        (LOSS_ROWS.replace("\n", "\ngarbage\n", 1), 2, "not a JSON record"),  # a bad line before good ones
        (LOSS_ROWS + '{"step": 4, "lo\n', 4, "not a JSON record"),  # cut short yet followed by a newline
        (LOSS_ROWS + "[1, 2]\n", 4, "not a JSON object but list"),
    ],
    ids=["bad-middle-line", "bad-last-line-with-newline", "not-an-object"],
)
def test_report_of_a_malformed_metrics_line_is_one_line_naming_it(tmp_path, text, line, what):
    from dflash_pipeline.train.report import main

    (tmp_path / "metrics.jsonl").write_text(text)
    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output  # no traceback
    assert result.output.strip().splitlines() == [
        next(line for line in result.output.splitlines() if line.startswith("dflash-report: error: "))
    ]
    assert f"metrics.jsonl: line {line} is {what}" in result.output
    assert not (tmp_path / "report.png").exists()


def test_report_skips_a_last_line_cut_short_by_a_crash_with_a_warning(tmp_path):
    from dflash_pipeline.train.metrics import read_records
    from dflash_pipeline.train.report import main

    (tmp_path / "metrics.jsonl").write_text(LOSS_ROWS + '{"step": 4, "loss": 1.2')  # kill -9 mid-write
    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "dflash-report: warning: " in result.output and "metrics.jsonl: line 4 is cut short" in result.output
    assert (tmp_path / "report.png").exists()
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")[0]] == [1, 2, 3]


def device_cli(name: str, monkeypatch, tmp_path):
    """A CLI's main, its required arguments and a list that receives the device its run was given."""
    seen: list[str] = []
    (tmp_path / "store").mkdir(exist_ok=True)
    if name == "extract":
        import dflash_pipeline.extract.run as module
        from dflash_pipeline.extract.cli import main

        monkeypatch.setattr(module, "run_extraction", lambda cfg: seen.append(cfg.device))
        return main, ["--target", "t", "--data", "d.jsonl", "--out", str(tmp_path / "o")], seen
    if name == "train":
        import dflash_pipeline.train.run as module
        from dflash_pipeline.train.cli import main

        monkeypatch.setattr(module, "run_training", lambda cfg: seen.append(cfg.device))
        return main, ["--store", str(tmp_path / "store"), "--out", str(tmp_path / "o")], seen
    import dflash_pipeline.train.eval_cli as module

    monkeypatch.setattr(module, "evaluate", lambda cfg: seen.append(cfg.device) or {"all_lossless": True})
    return module.main, ["--target", "t", "--drafter", "d", "--prompts", "p.jsonl"], seen


@pytest.mark.parametrize("name", ["extract", "train", "eval"])
@pytest.mark.parametrize(
    "has_cuda, args, device, line",
    [
        (False, [], "cpu", "running on cpu (no CUDA device)"),
        (True, [], "cuda", "running on cuda"),
        (True, ["--device", "cpu"], "cpu", "running on cpu"),
    ],
)
def test_device_auto_picks_cuda_when_there_is_one_and_the_first_line_says_so(
    monkeypatch, tmp_path, name, has_cuda, args, device, line
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    main, required, seen = device_cli(name, monkeypatch, tmp_path)
    result = CliRunner().invoke(main, required + args)
    assert result.exit_code == 0, result.output
    assert seen == [device]
    assert result.stderr.splitlines()[0] == f"dflash-{name}: {line}"


@pytest.mark.parametrize("name", ["extract", "train", "eval"])
def test_device_cuda_without_cuda_is_an_error_naming_the_option(monkeypatch, tmp_path, name):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main, required, seen = device_cli(name, monkeypatch, tmp_path)
    result = CliRunner().invoke(main, required + ["--device", "cuda"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit) and seen == []
    assert "'--device': cuda: no CUDA device is available" in result.stderr


@pytest.mark.parametrize("name", ["extract", "train"])
def test_gpus_on_the_cpu_is_a_one_line_error(monkeypatch, tmp_path, name):
    import torch

    from dflash_pipeline.extract.cli import main as extract_main
    from dflash_pipeline.train.cli import main as train_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main = extract_main if name == "extract" else train_main
    (tmp_path / "store").mkdir()
    required = ["--target", "t", "--data", "d.jsonl"] if name == "extract" else ["--store", str(tmp_path / "store")]
    result = CliRunner().invoke(main, required + ["--out", str(tmp_path / "o"), "--gpus", "0"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines()[-1] == f"dflash-{name}: error: --gpus 0: this run is on the CPU (no CUDA device)"
