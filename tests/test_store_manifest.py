"""Manifest: JSON round-trip, strict loading, and the one-line compatibility errors stage two shows."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.shared.store.manifest import (
    Manifest,
    ManifestError,
    ShardEntry,
    StoreIncomplete,
    StoreMismatch,
    check_compatible,
    load_manifest,
    new_manifest,
    resume_differences,
    write_manifest,
)

TARGET = {
    "name_or_path": "Qwen/Qwen3-8B",
    "architecture": "Qwen3ForCausalLM",
    "config_hash": "cfg123",
    "num_layers": 36,
    "hidden_size": 4096,
    "layer_ids": [1, 9, 17, 25, 33],
    "vocab_size": 151_936,
}


def make_manifest(**changes) -> Manifest:
    fields = dict(
        target=TARGET,
        hidden_dtype="bfloat16",
        world_size=2,
        tokenizer_fingerprint="tok1",
        data={"paths": ["a.jsonl"], "fingerprint": "d1", "max_length": 2048},
        settings={"regenerate": False},
    )
    return new_manifest(**{**fields, **changes})


def test_round_trip_and_derived_fields(tmp_path):
    m = make_manifest()
    write_manifest(tmp_path, m)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["storage_dtype"] == "uint16" and raw["complete"] is False and raw["format_version"] == 1
    loaded = load_manifest(tmp_path)
    assert loaded == m and loaded.root == str(tmp_path)
    assert loaded.hidden_width == 5 * 4096 and loaded.target["weights_fingerprint"] == ""
    m.shards = [
        ShardEntry(0, "shards/rank-00000.zarr", 2, 20),
        {"rank": 1, "path": "shards/rank-00001.zarr", "samples": 3, "tokens": 30},
    ]
    m.complete = True
    write_manifest(tmp_path, m)
    loaded = load_manifest(tmp_path)
    assert loaded.complete and [s.rank for s in loaded.shards] == [0, 1]
    assert (loaded.num_samples, loaded.num_tokens) == (5, 50)
    assert not [p for p in tmp_path.iterdir() if p.name != "manifest.json"]  # no temp file left


def test_bad_manifests_are_one_line_errors(tmp_path):
    with pytest.raises(ManifestError, match=f"{tmp_path}: no manifest.json"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format_version": 1, "target": ')
    with pytest.raises(ManifestError, match="manifest.json: corrupt manifest"):
        load_manifest(tmp_path)
    good = make_manifest().to_dict()
    for change, message in [
        ({"format_version": 99}, "format_version 99 is not supported"),
        ({"hidden_dtype": "int8"}, "hidden_dtype 'int8' is not one of"),
        ({"storage_dtype": "float32"}, "storage_dtype 'float32' does not carry hidden_dtype 'bfloat16'"),
        ({"target": {"name_or_path": "x"}}, "target lacks architecture, config_hash"),
        ({"surprise": 1}, "malformed manifest"),
    ]:
        (tmp_path / "manifest.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ManifestError, match=message) as info:
            load_manifest(tmp_path)
        assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


def test_check_compatible_names_the_store_and_the_field(tmp_path):
    m = make_manifest()
    write_manifest(tmp_path, m)
    loaded = load_manifest(tmp_path)
    with pytest.raises(StoreIncomplete, match=f"{tmp_path}: store is incomplete"):
        check_compatible(loaded)
    check_compatible(
        loaded, require_complete=False, config_hash="cfg123", layer_ids=(1, 9, 17, 25, 33), hidden_size=4096
    )
    for kwargs, message in [
        ({"config_hash": "other"}, "config_hash='cfg123', expected 'other'"),
        ({"layer_ids": [1, 9]}, r"layer_ids=\[1, 9, 17, 25, 33\], expected \[1, 9\]"),
        ({"hidden_size": 2048}, "hidden_size=4096, expected 2048"),
    ]:
        with pytest.raises(StoreMismatch, match=f"{tmp_path}: store was extracted with target {message}"):
            check_compatible(loaded, require_complete=False, **kwargs)


def test_resume_differences_ignore_what_completion_fills_in():
    running = make_manifest()
    running.data["counts"] = {"samples": 5}
    running.target["weights_fingerprint"] = "w1"
    running.complete, running.compression = True, "zstd:1"
    assert resume_differences(running, make_manifest()) == []
    other = make_manifest(
        target={**TARGET, "layer_ids": [2, 4]}, data={"paths": ["b.jsonl"], "fingerprint": "d2", "max_length": 2048}
    )
    assert resume_differences(running, other) == [
        "data.fingerprint: 'd1' -> 'd2'",
        "target.layer_ids: [1, 9, 17, 25, 33] -> [2, 4]",
    ]


def test_resume_differences_name_the_nested_setting_that_changed():
    """One line per changed leaf of nested settings, not the two whole dicts; a dict against anything else
    is one line; a field only one side has is said to be absent."""
    plan = {"layer_ids": [1, 9], "compute_dtype": "bfloat16", "compiled": True}
    sampled = {"method": "sampled", "temperature": 1.0, "seed": 0}
    running = make_manifest(settings={"plan": plan, "regenerate": sampled})
    rerun = make_manifest(
        settings={"plan": {**plan, "compute_dtype": "float32"}, "regenerate": {**sampled, "temperature": 0.7}}
    )
    assert resume_differences(running, rerun) == [
        "settings.plan.compute_dtype: 'bfloat16' -> 'float32'",
        "settings.regenerate.temperature: 1.0 -> 0.7",
    ]
    greedy = make_manifest(settings={"plan": plan, "regenerate": None})
    assert resume_differences(greedy, running) == [
        "settings.regenerate: None -> {'method': 'sampled', 'temperature': 1.0, 'seed': 0}"
    ]
    no_plan = make_manifest(settings={"regenerate": sampled})
    assert resume_differences(no_plan, running) == [f"settings.plan: (absent) -> {plan!r}"]


def test_resume_differences_compare_what_paths_name_not_how_they_were_typed():
    running = make_manifest(target={**TARGET, "name_or_path": "models/q", "location": "/abs/models/q"})
    respelled = make_manifest(
        target={**TARGET, "name_or_path": "./models/q", "location": "/abs/models/q"},
        data={"paths": ["/abs/a.jsonl"], "fingerprint": "d1", "max_length": 2048},
    )
    assert resume_differences(running, respelled) == []
    moved = make_manifest(target={**TARGET, "name_or_path": "models/q", "location": "/other/models/q"})
    assert resume_differences(running, moved) == ["target.location: '/abs/models/q' -> '/other/models/q'"]
