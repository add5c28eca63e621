"""PromptDataset validation: each bad-row kind names file and line; skip mode counts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reco_megatron.data.dataset import DatasetConfig, DatasetError, PromptDataset
from reco_megatron.data.tokenizer import SentencePieceTokenizer

SP_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "countdown_sp.model"
GOOD = json.dumps({"prompt": "What is 1+1?", "answer": "2"}).encode()


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


BAD_ROWS = [
    (b"\xff\xfe not utf-8", "invalid_utf8", "invalid UTF-8"),
    (b"{not json", "invalid_json", "not valid JSON"),
    (b"[1, 2]", "not_object", "expected a JSON object, got list"),
    (json.dumps({"answer": "2"}).encode(), "missing_field", "field 'prompt' is missing"),
    (json.dumps({"prompt": "q"}).encode(), "missing_field", "field 'answer' is missing"),
    (json.dumps({"prompt": 3, "answer": "2"}).encode(), "wrong_type", "must be a string, got int"),
    (json.dumps({"prompt": "q", "answer": [2]}).encode(), "wrong_type", "string or an integer"),
    (json.dumps({"prompt": "q", "answer": True}).encode(), "wrong_type", "got bool"),
    (json.dumps({"prompt": "  ", "answer": "2"}).encode(), "empty_text", "'prompt' is empty"),
    (b'{"prompt": "\\ud800", "answer": "1"}', "invalid_unicode", "unencodable"),
    (json.dumps({"prompt": "x" * 50, "answer": "2"}).encode(), "too_long", "50 characters"),
    # json.loads raises ValueError (not JSONDecodeError) past 4300 digits: was a traceback
    (b'{"prompt": "q", "answer": ' + b"9" * 5001 + b"}", "invalid_json", "number too large"),
    (json.dumps({"prompt": "y" * 9000, "answer": "2"}).encode(), "too_long", "max_row_bytes=8192"),
]


@pytest.mark.parametrize(("row", "kind", "message"), BAD_ROWS)
def test_each_bad_row_kind_names_file_and_line(
    tmp_path: Path, row: bytes, kind: str, message: str
) -> None:
    path = _write(tmp_path / "data.jsonl", [GOOD, b"", GOOD, row, GOOD])
    with pytest.raises(DatasetError, match=message) as info:
        PromptDataset(path, DatasetConfig(max_prompt_len=40, max_row_bytes=8192))
    assert (info.value.line, info.value.kind) == (4, kind)
    assert str(info.value).startswith(f"{path}:4: ")
    assert "on_bad_row='skip'" in str(info.value)


def test_skip_mode_counts_every_kind(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.jsonl", [GOOD] + [row for row, _, _ in BAD_ROWS] + [GOOD])
    ds = PromptDataset(
        path, DatasetConfig(max_prompt_len=40, on_bad_row="skip", max_row_bytes=8192)
    )
    assert len(ds) == 2
    expected: dict[str, int] = {}
    for _, kind, _ in BAD_ROWS:
        expected[kind] = expected.get(kind, 0) + 1
    assert dict(ds.skipped) == expected
    assert ds.num_skipped == len(BAD_ROWS)
    assert [r.source for r in ds] == ["data.jsonl:1", f"data.jsonl:{len(BAD_ROWS) + 2}"]


def test_records_fields_ids_and_custom_names(tmp_path: Path) -> None:
    rows = [{"q": "Add 2 and 3.", "a": 5, "uid": "p-1"}, {"q": "Say hi.", "a": "hi"}]
    path = _write(tmp_path / "d.jsonl", [json.dumps(r).encode() for r in rows])
    ds = PromptDataset(path, DatasetConfig(prompt_field="q", answer_field="a", id_field="uid"))
    assert [(r.prompt, r.answer, r.id) for r in ds] == [
        ("Add 2 and 3.", "5", "p-1"),
        ("Say hi.", "hi", "d.jsonl:2"),
    ]


def test_token_length_limit_uses_the_tokenizer(tmp_path: Path) -> None:
    tok = SentencePieceTokenizer(SP_MODEL)
    prompt = "Using the numbers [3, 5], write 8."
    path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": prompt, "answer": "8"}).encode()])
    n_tokens = len(tok.encode(prompt))
    assert n_tokens < len(prompt)
    assert len(PromptDataset(path, DatasetConfig(max_prompt_len=n_tokens), tokenizer=tok)) == 1
    with pytest.raises(DatasetError, match=f"{n_tokens} tokens, more than"):
        PromptDataset(path, DatasetConfig(max_prompt_len=n_tokens - 1), tokenizer=tok)


def test_parquet_rows_are_validated(tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": pa.array([b"ok prompt", b"\xff\xfe", None, b"another"], pa.binary()),
            "answer": pa.array(["1", "2", "3", "4"]),
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match="not valid UTF-8") as info:
        PromptDataset(path)
    assert info.value.line == 2
    ds = PromptDataset(path, DatasetConfig(on_bad_row="skip"))
    assert [r.prompt for r in ds] == ["ok prompt", "another"]
    assert dict(ds.skipped) == {"invalid_utf8": 1, "missing_field": 1}
    with pytest.raises(DatasetError, match="no column 'question'"):
        PromptDataset(path, DatasetConfig(prompt_field="question"))


_PEAK = """
import resource, sys
from reco_megatron.data.dataset import DatasetConfig, PromptDataset
from reco_megatron.data.tokenizer import SentencePieceTokenizer
tok = SentencePieceTokenizer(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = DatasetConfig(max_prompt_len=64, on_bad_row="skip")
ds = PromptDataset(sys.argv[1], cfg, tokenizer=tok)
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
print(len(ds), dict(ds.skipped), peak)
"""


def test_a_huge_line_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A 20 MB line: before, the start-up check decoded, parsed and tokenised all of it (a
    50 MB line peaked at 3.6 GB); now it is skipped after reading max_row_bytes of it."""
    import subprocess
    import sys

    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.write(
            GOOD + b"\n" + b'{"prompt": "' + b"7 + " * (5 << 20) + b'", "answer": "1"}\n' + GOOD
        )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path), str(SP_MODEL)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows, peak_mib = done.stdout.split()[0], done.stdout.split()[-1]
    assert rows == "2" and "{'too_long': 1}" in done.stdout
    assert int(peak_mib) < 64, f"peak grew by {peak_mib} MiB while reading a 20 MB line"


def test_parquet_rows_over_the_size_limit_are_skipped(tmp_path: Path) -> None:
    table = pa.table({"prompt": ["short", "z" * 5000, "fine"], "answer": ["1", "2", "3"]})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    ds = PromptDataset(path, DatasetConfig(on_bad_row="skip", max_row_bytes=1024))
    assert [r.prompt for r in ds] == ["short", "fine"] and dict(ds.skipped) == {"too_long": 1}
    with pytest.raises(DatasetError, match=r"d.parquet:2: row is 5001 bytes, over"):
        PromptDataset(path, DatasetConfig(max_row_bytes=1024))


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"unknown file type '\.csv'"):
        PromptDataset(tmp_path / "d.csv")
    with pytest.raises(DatasetError, match="cannot open"):
        PromptDataset(tmp_path / "missing.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        PromptDataset(tmp_path / "bad.parquet")
    path = _write(tmp_path / "all_bad.jsonl", [b"{", b"["])
    with pytest.raises(DatasetError, match="no valid rows"):
        PromptDataset(path, DatasetConfig(on_bad_row="skip"))
    with pytest.raises(ValueError, match="on_bad_row must be"):
        DatasetConfig(on_bad_row="ignore")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
_rows = st.one_of(
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ")),
    st.dictionaries(st.sampled_from(["prompt", "answer", "id", "x"]), _json_values).map(
        lambda d: json.dumps(d).encode()
    ),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rows=st.lists(_rows, min_size=1, max_size=8), skip=st.booleans())
def test_fuzzed_rows_load_or_raise_only_dataset_error(
    tmp_path: Path, rows: list[bytes], skip: bool
) -> None:
    path = _write(tmp_path / "fuzz.jsonl", rows)
    try:
        ds = PromptDataset(path, DatasetConfig(on_bad_row="skip" if skip else "error"))
    except DatasetError as exc:
        assert str(path) in str(exc)
        return
    for record in ds:
        assert isinstance(record.prompt, str) and record.prompt.strip()
        assert isinstance(record.answer, str) and record.answer.strip()
