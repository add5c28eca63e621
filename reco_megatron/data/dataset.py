"""Prompt datasets from local JSON-lines or Parquet files, every row validated.

A row becomes a :class:`PromptRecord` ``(prompt, answer, id, source)`` where ``source`` is
``"path:line"`` (1-based line of a ``.jsonl`` file, 1-based row of a ``.parquet`` file).
Field names are configurable. A row is *bad* when it is not valid UTF-8, not JSON, not a
JSON object, lacks the prompt or answer field, has the wrong type (prompt: str; answer: str
or int; id: str or int), has empty text, contains unencodable text (lone surrogates), or has
a prompt longer than ``max_prompt_len`` (tokens with a tokenizer, else characters).

``on_bad_row="error"`` (default) raises :class:`DatasetError` naming the file, the line and
the problem; ``"skip"`` drops the row and counts it by kind in ``dataset.skipped``. Blank
lines in ``.jsonl`` files are ignored. Files are read once, at construction.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reco_megatron.data.tokenizer import Tokenizer
from reco_megatron.utils.logging import get_logger

log = get_logger(__name__)

BAD_ROW_KINDS: tuple[str, ...] = (
    "invalid_utf8",
    "invalid_json",
    "not_object",
    "missing_field",
    "wrong_type",
    "empty_text",
    "invalid_unicode",
    "too_long",
)


class DatasetError(ValueError):
    """A dataset file or row is invalid. ``path``, ``line`` (None: whole file), ``kind``."""

    def __init__(self, path: str, line: int | None, kind: str, reason: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        hint = "; fix the row or set on_bad_row='skip'" if line is not None else ""
        super().__init__(f"{where}: {reason}{hint}")
        self.path, self.line, self.kind, self.reason = path, line, kind, reason


class _BadRow(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: ``prompt`` text, ``answer`` (the reward's gold), ``id``, ``source``."""

    prompt: str
    answer: str
    id: str
    source: str


@dataclass(kw_only=True)
class DatasetConfig:
    """How to read a prompt file."""

    prompt_field: str = "prompt"
    """Row field holding the prompt text."""
    answer_field: str = "answer"
    """Row field holding the reference answer."""
    id_field: str | None = "id"
    """Row field holding an id; rows without one get ``"file:line"``."""
    max_prompt_len: int | None = None
    """Longest prompt kept: tokens when a tokenizer is given, else characters."""
    max_row_bytes: int = 1 << 20
    """Longest row (a ``.jsonl`` line, or a Parquet row's prompt + answer) in bytes; a longer
    one is a bad row (``too_long``) read in bounded memory, never parsed or tokenised."""
    on_bad_row: str = "error"
    """``"error"``: raise on the first bad row; ``"skip"``: drop and count bad rows."""

    def __post_init__(self) -> None:
        if self.on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        if not isinstance(self.max_row_bytes, int) or self.max_row_bytes < 1024:
            raise ValueError(f"max_row_bytes must be >= 1024, got {self.max_row_bytes!r}")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1 or None, got {self.max_prompt_len!r}")
        for name in ("prompt_field", "answer_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")


def _text(row: dict, field: str, *, allow_int: bool) -> str:
    if field not in row or row[field] is None:
        raise _BadRow("missing_field", f"field {field!r} is missing (row keys: {sorted(row)[:8]})")
    value = row[field]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadRow("invalid_utf8", f"field {field!r} is not valid UTF-8 ({exc})") from exc
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        expected = "a string or an integer" if allow_int else "a string"
        raise _BadRow(
            "wrong_type",
            f"field {field!r} must be {expected}, got {type(value).__name__} {str(value)[:40]!r}",
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _BadRow("invalid_unicode", f"field {field!r} has unencodable text ({exc})") from exc
    if not value.strip():
        raise _BadRow("empty_text", f"field {field!r} is empty")
    return value


def _bounded_lines(handle: Any, limit: int) -> Iterator[bytes | None]:
    """The lines of a binary file, each read with at most ``limit + 1`` bytes in memory; a
    longer line is consumed in chunks and yielded as None."""
    while True:
        raw = handle.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or (raw.endswith(b"\n") and len(raw) == limit + 1):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = handle.readline(1 << 20)
        yield None


def _cell_bytes(pc: Any, column: Any) -> list[int]:
    """Bytes of each cell of a string/binary column (0 for nulls and other types)."""
    import pyarrow as pa

    if not (
        pa.types.is_string(column.type)
        or pa.types.is_large_string(column.type)
        or pa.types.is_binary(column.type)
        or pa.types.is_large_binary(column.type)
    ):
        return [0] * len(column)
    return [n or 0 for n in pc.binary_length(column).to_pylist()]


class PromptDataset(Sequence[PromptRecord]):
    """The validated records of one file; ``dataset[i]`` is a :class:`PromptRecord`."""

    def __init__(
        self,
        path: str | Path,
        config: DatasetConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.path = str(path)
        self.config = config or DatasetConfig()
        self.tokenizer = tokenizer
        self.skipped: Counter[str] = Counter()
        self.records: list[PromptRecord] = []
        suffix = Path(self.path).suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            rows = self._jsonl_rows()
        elif suffix in (".parquet", ".pq"):
            rows = self._parquet_rows()
        else:
            raise DatasetError(
                self.path, None, "format", f"unknown file type {suffix!r}: use .jsonl or .parquet"
            )
        for line, row in rows:
            try:
                self.records.append(self._record(line, row))
            except _BadRow as bad:
                if self.config.on_bad_row == "error":
                    raise DatasetError(self.path, line, bad.kind, bad.reason) from None
                self.skipped[bad.kind] += 1
        if self.skipped:
            log.warning(
                "%s: skipped %d bad rows %s", self.path, self.num_skipped, dict(self.skipped)
            )
        if not self.records:
            raise DatasetError(
                self.path, None, "empty", f"no valid rows (skipped: {dict(self.skipped)})"
            )

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:  # type: ignore[override]
        return self.records[index]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)

    def _record(self, line: int, row: Any) -> PromptRecord:
        if isinstance(row, _BadRow):
            raise row
        if not isinstance(row, dict):
            raise _BadRow("not_object", f"expected a JSON object, got {type(row).__name__}")
        cfg = self.config
        prompt = _text(row, cfg.prompt_field, allow_int=False)
        answer = _text(row, cfg.answer_field, allow_int=True)
        source = f"{Path(self.path).name}:{line}"
        row_id = source
        if cfg.id_field and row.get(cfg.id_field) is not None:
            row_id = _text(row, cfg.id_field, allow_int=True)
        if cfg.max_prompt_len is not None:
            length = len(self.tokenizer.encode(prompt)) if self.tokenizer else len(prompt)
            if length > cfg.max_prompt_len:
                unit = "tokens" if self.tokenizer else "characters"
                raise _BadRow(
                    "too_long",
                    f"prompt has {length} {unit}, more than max_prompt_len={cfg.max_prompt_len}",
                )
        return PromptRecord(prompt=prompt, answer=answer, id=row_id, source=source)

    def _jsonl_rows(self) -> Iterator[tuple[int, Any]]:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise DatasetError(self.path, None, "io", f"cannot open ({exc})") from exc
        limit = self.config.max_row_bytes
        with handle:
            for line_no, raw in enumerate(_bounded_lines(handle, limit), start=1):
                if raw is None:
                    yield (
                        line_no,
                        _BadRow(
                            "too_long",
                            f"line is over data.dataset.max_row_bytes={limit} bytes (skipped "
                            "without reading it into memory; raise max_row_bytes if it is real)",
                        ),
                    )
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield (
                        line_no,
                        _BadRow(
                            "invalid_utf8", f"invalid UTF-8 ({exc.reason} at byte {exc.start})"
                        ),
                    )
                    continue
                if not text.strip():
                    continue
                try:
                    yield line_no, json.loads(text)
                except (json.JSONDecodeError, RecursionError) as exc:
                    yield line_no, _BadRow("invalid_json", f"not valid JSON ({str(exc)[:80]})")
                except ValueError as exc:  # e.g. an integer of more than 4300 digits
                    yield (
                        line_no,
                        _BadRow(
                            "invalid_json", f"a number too large to represent ({str(exc)[:80]})"
                        ),
                    )

    def _parquet_rows(self) -> Iterator[tuple[int, Any]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(self.path, None, "io", f"cannot read as Parquet ({exc})") from exc
        names = set(parquet.schema_arrow.names)
        for field in (self.config.prompt_field, self.config.answer_field):
            if field not in names:
                raise DatasetError(
                    self.path,
                    None,
                    "missing_field",
                    f"no column {field!r} (columns: {sorted(names)}); set prompt_field/"
                    "answer_field to the file's column names",
                )
        import pyarrow.compute as pc

        row_no = 0
        limit = self.config.max_row_bytes
        fields = [self.config.prompt_field, self.config.answer_field]
        for batch in parquet.iter_batches(batch_size=256):
            sizes = [_cell_bytes(pc, batch.column(f)) for f in fields]
            total = [sum(parts) for parts in zip(*sizes, strict=True)]
            too_long = [n > limit for n in total]
            if any(too_long):  # drop the long cells before they become Python strings
                mask = pa.array(too_long)
                columns = [
                    pc.if_else(mask, pa.nulls(len(batch), type=col.type), col)
                    if name in fields
                    else col
                    for name, col in zip(batch.schema.names, batch.columns, strict=True)
                ]
                batch = pa.RecordBatch.from_arrays(columns, names=batch.schema.names)
            for row, long, size in zip(batch.to_pylist(), too_long, total, strict=True):
                row_no += 1
                if long:
                    yield (
                        row_no,
                        _BadRow(
                            "too_long",
                            f"row is {size} bytes, over data.dataset.max_row_bytes={limit}",
                        ),
                    )
                else:
                    yield row_no, row
