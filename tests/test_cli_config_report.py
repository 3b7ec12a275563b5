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
    result, cfg = captured_train_config(monkeypatch, tmp_path, [
        "--config", str(toml), "--store", str(tmp_path / "store"), "--out", str(tmp_path / "o"),
        "--device", "cpu", "--block-size", "8"])
    assert result.exit_code == 0, result.output
    assert (cfg.num_layers, cfg.block_size, cfg.lr) == (3, 8, 1e-4)


@pytest.mark.parametrize("text, message", [
    ("[train]\nnum_layer = 3\n", "unknown keys in [train]: num_layer"),
    ("[train\n", "not valid TOML"),
])
def test_bad_config_file_is_a_clear_error(monkeypatch, tmp_path, text, message):
    (tmp_path / "store").mkdir()
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    result, cfg = captured_train_config(monkeypatch, tmp_path, [
        "--config", str(toml), "--store", str(tmp_path / "store"), "--out", str(tmp_path / "o"), "--device", "cpu"])
    assert result.exit_code != 0 and cfg is None
    assert message in result.output and "run.toml" in result.output


def test_report_draws_a_png_of_loss_and_tau(tmp_path):
    from dflash_pipeline.train.report import main

    rows = [{"step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 21)] + [{"step": 10, "type": "eval", "tau": 1.5},
                                                                            {"step": 20, "type": "eval", "tau": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code == 0, result.output
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_without_metrics_is_a_clear_error(tmp_path):
    from dflash_pipeline.train.report import main

    result = CliRunner().invoke(main, ["--run", str(tmp_path)])
    assert result.exit_code != 0 and "metrics.jsonl: no metrics" in result.output
