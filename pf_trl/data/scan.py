"""A streaming check of JSON Lines sources, before anything heavy runs: the first malformed line is reported as one
line with its number (the Arrow JSON reader says neither which line nor, counting from 0, the same number).

The scan reads one line at a time (constant memory) and is remembered per file version (path, size, mtime) in the
pf-trl cache, so a file is scanned once, not on every run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pf_trl.errors import PfTrlError

LINE_SUFFIXES = (".jsonl", ".json")


class JsonLinesError(PfTrlError, ValueError):
    """A JSON Lines source has a malformed line; the message names the file, the line and the fix."""


def first_bad_line(path: str | Path) -> str | None:
    """``"line N: <what is wrong>"`` for the first malformed line of a JSON Lines file, None when every line is a JSON
    object (or the file is not line-oriented: a JSON array or one object spread over several lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"{"):
        return None  # a JSON array, or not JSON at all: the reader's own error says so
    with open(path, encoding="utf-8", errors="strict") as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    if lineno == 1 and _is_one_json_document(path):
                        return None  # one object over several lines (pretty-printed JSON), not JSON Lines
                    return f"line {lineno}: {exc.msg} (column {exc.colno})"
                if not isinstance(value, dict):
                    return f"line {lineno}: expected a JSON object, got {type(value).__name__}"
        except UnicodeDecodeError as exc:
            return f"line {lineno + 1}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
    return None


def _is_one_json_document(path: str | Path, limit: int = 64 << 20) -> bool:
    """True when the file (up to ``limit`` bytes) is one JSON document, e.g. a pretty-printed object."""
    if Path(path).stat().st_size > limit:
        return True  # too big to parse whole here: the reader decides
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _memo(path: Path) -> Path | None:
    from pf_trl.data.tokenizer import cache_root

    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    return cache_root() / "scanned" / hashlib.sha256(key.encode()).hexdigest()[:32]


def check_json_lines(path: str | Path, *, flag: str = "source") -> None:
    """Raise :class:`JsonLinesError` at the first malformed line of a ``.jsonl`` / ``.json`` source (other files:
    nothing to do). A file version that passed is remembered and not scanned again."""
    source = Path(path).expanduser()
    if source.suffix.lower() not in LINE_SUFFIXES or not source.is_file():
        return
    memo = _memo(source)
    if memo is not None and memo.is_file():
        return
    problem = first_bad_line(source)
    if problem is not None:
        raise JsonLinesError(f"{flag} {path}: {problem}; fix or remove that line")
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.touch()
        except OSError:
            pass  # a read-only cache only costs a scan next time
