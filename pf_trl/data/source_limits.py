"""Limits on what one row of a source may hold, checked as a stream before a reader parses it.

Readers are fragile on hostile rows: Arrow's JSON reader crashes on a row nested 20,000 deep, a 200 MB line is
held whole (several times over) by every reader, and a Parquet file of a few KB may declare gigabytes of
compressed pages. :func:`check_source_limits` reads a source file once, in bounded memory, and refuses it by line
or row group *before* the reader sees it; :func:`check_table_limits` checks loaded Arrow data (any format)
column by column. The preprocessing service applies them to every source it reads (``--max-row-bytes``,
``--max-json-depth``, ``--max-field-bytes``; docs/service.md); :func:`pf_trl.pretokenize` applies them when given
``limits=``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pf_trl.data.formats import FormatError


class SourceLimitError(FormatError):
    """A row breaks a limit; the message names the line / row / column, the limit and the fix."""


@dataclass(frozen=True)
class SourceLimits:
    """Per-row limits of a source.

    Attributes:
        max_row_bytes: longest line of a JSON Lines or CSV file (a row), in bytes.
        max_json_depth: deepest nesting of arrays and objects in a JSON row (a JSON array file: in the file).
        max_field_bytes: longest single value (a string, or the bytes of a list) in a loaded row.
        max_row_group_bytes: largest uncompressed row group a Parquet file may declare (a decompression bomb
            declares its size there).
    """

    max_row_bytes: int = 32 * 2**20
    max_json_depth: int = 64
    max_field_bytes: int = 16 * 2**20
    max_row_group_bytes: int = 1 * 2**30

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


_JSON_STRUCTURE = re.compile(rb'["\\\[\]{}]')
_BLOCK = 1 << 20


class JsonDepthScanner:
    """Tracks the nesting depth of JSON text fed in chunks (strings and escapes respected, nothing parsed)."""

    def __init__(self, limit: int):
        self.limit, self.depth, self.deepest = limit, 0, 0
        self._in_string, self._escaped = False, False

    def feed(self, chunk: bytes, *, last: bool = False) -> bool:
        """False as soon as the depth passes the limit. ``last``: no chunk follows (the state at its end is moot)."""
        if last and chunk.count(b"[") + chunk.count(b"{") + self.depth <= self.limit:
            return True  # even if every bracket opened, the limit would hold: nothing to scan
        skip = -1
        if self._escaped:
            skip, self._escaped = 0, False
        for m in _JSON_STRUCTURE.finditer(chunk):
            at = m.start()
            if at == skip:
                continue
            c = chunk[at]
            if self._in_string:
                if c == 0x5C:  # backslash: the next character is escaped
                    if at + 1 == len(chunk):
                        self._escaped = True
                    skip = at + 1
                elif c == 0x22:
                    self._in_string = False
            elif c == 0x22:
                self._in_string = True
            elif c in (0x5B, 0x7B):
                self.depth += 1
                if self.depth > self.deepest:
                    self.deepest = self.depth
                    if self.depth > self.limit:
                        return False
            elif c in (0x5D, 0x7D):
                self.depth -= 1
        return True


def _line_limits(path: Path, limits: SourceLimits, *, json_rows: bool, max_rows: int | None) -> int:
    """Stream a line-oriented file; returns the rows seen. Raises on the first line over a limit."""
    rows = 0
    with open(path, "rb") as f:
        lineno = 0
        while True:
            line = f.readline(limits.max_row_bytes + 2)  # bounded: a 200 MB line is never held whole
            if not line:
                return rows
            lineno += 1
            if len(line) > limits.max_row_bytes + (1 if line.endswith(b"\n") else 0):
                raise SourceLimitError(
                    f"line {lineno} is longer than {limits.max_row_bytes} bytes (max_row_bytes); split the row, "
                    "or ask the operator to raise the limit (--max-row-bytes)")
            if not line.strip():
                continue
            rows += 1
            if json_rows:
                if not JsonDepthScanner(limits.max_json_depth).feed(line, last=True):
                    raise SourceLimitError(
                        f"line {lineno} nests arrays/objects deeper than {limits.max_json_depth} levels "
                        "(max_json_depth); flatten the row, or ask the operator to raise the limit (--max-json-depth)")
            if max_rows is not None and rows >= max_rows:
                return rows


def _json_array_limits(path: Path, limits: SourceLimits) -> None:
    scanner = JsonDepthScanner(limits.max_json_depth)
    with open(path, "rb") as f:
        offset = 0
        while block := f.read(_BLOCK):
            if not scanner.feed(block):
                raise SourceLimitError(
                    f"the JSON nests arrays/objects deeper than {limits.max_json_depth} levels (max_json_depth) "
                    f"within its first {offset + len(block)} bytes; flatten the rows (JSON Lines is best)")
            offset += len(block)


def _type_depth(arrow_type) -> int:
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        return 1 + max((_type_depth(arrow_type.field(i).type) for i in range(arrow_type.num_fields)), default=0)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return 1 + _type_depth(arrow_type.value_type)
    if pa.types.is_map(arrow_type):
        return 1 + max(_type_depth(arrow_type.key_type), _type_depth(arrow_type.item_type))
    return 0


def _parquet_limits(path: Path, limits: SourceLimits) -> None:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(path))
    depth = max((_type_depth(f.type) for f in pf.schema_arrow), default=0)
    if depth > limits.max_json_depth:
        raise SourceLimitError(f"{path.name}: its columns nest {depth} levels deep, more than {limits.max_json_depth} "
                               "(max_json_depth); flatten the data")
    meta = pf.metadata
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        declared = sum(max(group.column(c).total_uncompressed_size, 0) for c in range(group.num_columns))
        declared = max(declared, group.total_byte_size)
        if declared > limits.max_row_group_bytes:
            raise SourceLimitError(
                f"{path.name}: row group {g} holds {declared} bytes uncompressed, more than {limits.max_row_group_bytes} "
                "(max_row_group_bytes); write it with smaller row groups (pyarrow row_group_size) or less data per row")


def check_source_limits(path: str | Path, limits: SourceLimits, *, max_rows: int | None = None) -> int | None:
    """Check a source file against ``limits`` before it is parsed; returns the rows of a line-oriented file
    (None otherwise). ``max_rows``: stop after that many rows (a preflight of the head).

    Raises:
        SourceLimitError: the first line / row group over a limit, named.
    """
    path = Path(path)
    if path.is_dir():
        return None  # Arrow files: nothing to parse; check_table_limits checks the loaded columns
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        _parquet_limits(path, limits)
        return None
    if suffix in (".json", ".jsonl"):
        with open(path, "rb") as f:
            array = f.read(4096).lstrip().startswith(b"[")
        if array:
            _json_array_limits(path, limits)
            return None
        return _line_limits(path, limits, json_rows=True, max_rows=max_rows)
    if suffix == ".csv":
        return _line_limits(path, limits, json_rows=False, max_rows=max_rows)
    return None


def _value_bytes(array) -> int:
    """The largest value of an Arrow array in bytes: strings/binary by length; lists by their flattened bytes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = array.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        top = pc.max(pc.binary_length(array)).as_py()
        return int(top or 0)
    if pa.types.is_struct(t):
        return max((_value_bytes(array.field(i)) for i in range(t.num_fields)), default=0)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _value_bytes(array.flatten())
    return 0


def check_table_limits(table, limits: SourceLimits) -> None:
    """Check loaded Arrow data (a ``pyarrow.Table`` or a ``datasets.Dataset``) against the depth and field limits,
    one chunk at a time (the data stays memory-mapped)."""
    data = getattr(table, "data", table)  # datasets.Dataset -> its pyarrow table
    data = getattr(data, "table", data)
    for name in data.column_names:
        column = data.column(name)
        depth = _type_depth(column.type)
        if depth > limits.max_json_depth:
            raise SourceLimitError(f"column {name!r} nests {depth} levels deep, more than {limits.max_json_depth} "
                                   "(max_json_depth); flatten the data")
        for chunk in column.chunks:
            top = _value_bytes(chunk)
            if top > limits.max_field_bytes:
                raise SourceLimitError(
                    f"column {name!r} holds a value of {top} bytes, more than {limits.max_field_bytes} (max_field_bytes); "
                    "shorten it, or ask the operator to raise the limit (--max-field-bytes)")


def limits_from(values: dict[str, Any] | None) -> SourceLimits | None:
    """``SourceLimits(**values)``, or None for None."""
    return None if values is None else SourceLimits(**values)
