"""Every reader, every malformed-input case: counted skips that name the record, never a crash."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.data.normalize import Skip, normalize
from eagle3.data.readers import Raw, ReadStats, fingerprint_source, iter_source, resolve_source

SG = {"id": "a1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
OA = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def read(path):
    st = ReadStats()
    return list(iter_source(path, st)), st


def test_json_array_truncated_tail(tmp_path):
    recs = [dict(SG, id=f"r{i}") for i in range(3)]
    text = json.dumps(recs, indent=2)
    p = tmp_path / "trunc.json"
    p.write_text(text[: text.rfind('"hello"') + 3])  # cut inside the last record
    out, st = read(p)
    assert [r.record_id for r in out] == ["r0", "r1"]
    assert st.unreadable_tail_bytes > 0 and "truncated" in st.notes[0]


def test_json_array_malformed_record_mid_file_resyncs(tmp_path):
    good = json.dumps(SG)
    p = tmp_path / "mid.json"
    p.write_text("[" + good + ", {\"id\": \"bad\", \"conversations\": [ {\"from\": }]}, "
                 + good.replace("a1", "a2") + "]")
    out, st = read(p)
    assert [type(r).__name__ for r in out] == ["Raw", "Bad", "Raw"]
    assert out[1].reason == "malformed_json" and out[2].record_id == "a2"
    assert st.unreadable_tail_bytes == 0


def test_json_array_small_chunks_equal_one_chunk(tmp_path):
    from eagle3.data.readers import iter_json_array

    p = tmp_path / "many.json"
    p.write_text(json.dumps([dict(SG, id=f"r{i}") for i in range(50)]))
    a = [r.record_id for r in iter_json_array(p, ReadStats(), chunk=7)]
    b = [r.record_id for r in iter_json_array(p, ReadStats())]
    assert a == b == [f"r{i}" for i in range(50)]


def test_non_utf8_costs_one_record(tmp_path):
    p = tmp_path / "enc.json"
    good, bad = json.dumps(SG).encode(), json.dumps(dict(SG, id="latin")).encode().replace(b"hello", b"h\xe9llo")
    p.write_bytes(b"[" + good + b"," + bad + b"," + good.replace(b"a1", b"a3") + b"]")
    out, _ = read(p)
    assert [(type(r).__name__, r.record_id) for r in out] == [("Raw", "a1"), ("Bad", "latin"), ("Raw", "a3")]
    assert out[1].reason == "non_utf8"


def test_jsonl_both_forms_and_bad_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\n".join([
        json.dumps(SG).encode(), json.dumps(OA).encode(), b"{not json", b"[1, 2]",
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', b"", json.dumps(dict(SG, id="z")).encode(),
    ]))
    out, _ = read(p)
    kinds = [(type(r).__name__, r.record_id, getattr(r, "reason", "")) for r in out]
    assert kinds == [
        ("Raw", "a1", ""), ("Raw", "d.jsonl:2", ""), ("Bad", "d.jsonl:3", "malformed_json"),
        ("Bad", "d.jsonl:4", "not_an_object"), ("Bad", "d.jsonl:5", "non_utf8"), ("Raw", "z", ""),
    ]
    assert normalize(out[0].obj) == normalize(out[1].obj) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_parquet_and_hf_datasets_dir(tmp_path):
    rows = [dict(OA, id=f"p{i}") for i in range(5)]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "x.parquet")
    out, _ = read(tmp_path / "x.parquet")
    assert [r.record_id for r in out] == [f"p{i}" for i in range(5)]
    assert normalize(out[0].obj)[1]["content"] == "hello"
    # `datasets.save_to_disk` layout: Arrow IPC *stream* files + json metadata.
    d = tmp_path / "hf"
    d.mkdir()
    with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (d / "dataset_info.json").write_text("{}")
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    out2, _ = read(d)
    assert [r.record_id for r in out2 if isinstance(r, Raw)] == [f"p{i}" for i in range(5)]


def test_fingerprint_is_content_not_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(SG) + "\n")
    b.write_text(json.dumps(SG) + "\n")
    assert fingerprint_source(a) == fingerprint_source(b)
    b.write_text(json.dumps(OA) + "\n")
    assert fingerprint_source(a) != fingerprint_source(b)


def test_bundled_sharegpt_is_streamed_despite_truncation():
    path = resolve_source("sharegpt")
    st = ReadStats()
    n_raw = sum(isinstance(r, Raw) for r in iter_source(path, st))
    assert n_raw == 17671  # every complete record of the bundled (truncated) file
    assert st.unreadable_tail_bytes > 0


def test_unknown_source_is_a_clear_error():
    with pytest.raises(ValueError, match="does not exist"):
        resolve_source("/nonexistent/file.jsonl")


# ---------------------------------------------------------------- normalization
def conv(*turns, form="sg"):
    if form == "sg":
        return {"conversations": [{"from": r, "value": c} for r, c in turns]}
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def test_roles_are_mapped():
    for r in ["gpt", "chatgpt", "bing", "bard", "assistant"]:
        assert normalize(conv(("human", "q"), (r, "a")))[1] == {"role": "assistant", "content": "a"}
    assert normalize(conv(("system", "s"), ("user", "q"), ("gpt", "a")))[0]["role"] == "system"


@pytest.mark.parametrize("obj,reason", [
    (conv(("human", "q"), ("robot", "a")), "unknown_role"),
    (conv(("human", "q"), (None, "a")), "unknown_role"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}, "missing_content"),
    (conv(("human", "q"), ("gpt", None)), "missing_content"),
    (conv(("human", "q"), ("gpt", "   ")), "empty_turn"),
    (conv(("human", "q"), ("gpt", "")), "empty_turn"),
    ({"conversations": []}, "empty_conversation"),
    (conv(("human", "q")), "no_assistant_turn"),
    (conv(("gpt", "a"), ("gpt", "b")), "no_assistant_turn"),
    (conv(("human", "q"), ("gpt", "a"), ("system", "s")), "system_not_first"),
    ({"text": "no turns"}, "bad_schema"),
    ({"conversations": "hi"}, "bad_schema"),
    ({"conversations": ["hi"]}, "bad_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                   {"role": "assistant", "content": "a"}]}, "missing_content"),
])
def test_skip_reasons(obj, reason):
    with pytest.raises(Skip) as e:
        normalize(obj)
    assert e.value.reason == reason


def test_leading_non_user_turns_dropped_and_trailing_user_dropped():
    got = normalize(conv(("gpt", "stale answer"), ("human", "q"), ("gpt", "a"), ("human", "unanswered")))
    assert got == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_same_role_merge_or_drop():
    c = conv(("human", "q1"), ("human", "q2"), ("gpt", "a1"), ("gpt", "a2"))
    assert normalize(c) == [{"role": "user", "content": "q1\n\nq2"}, {"role": "assistant", "content": "a1\n\na2"}]
    with pytest.raises(Skip) as e:
        normalize(c, same_role="drop")
    assert e.value.reason == "same_role"


def test_openai_content_parts():
    obj = {"messages": [{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]},
                        {"role": "assistant", "content": "ok"}]}
    assert normalize(obj)[0]["content"] == "hey"
