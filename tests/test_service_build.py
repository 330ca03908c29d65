"""A job's checks that the accepted source and tokenizer are unchanged, without hashing either twice."""

from __future__ import annotations

import os

import pytest


def test_an_unchanged_source_is_not_hashed_again(tmp_path, monkeypatch):
    import pf_trl.data.pretokenize as pt
    from pf_trl.data.integrity import content_stat
    from preprocess_service.build import JobError, ensure_source_unchanged

    src = tmp_path / "rows.jsonl"
    src.write_text('{"text": "a"}\n')
    sha, stat = pt.source_fingerprint(src), content_stat(src)
    real = pt.source_fingerprint
    calls = []
    monkeypatch.setattr(pt, "source_fingerprint", lambda p: calls.append(p) or real(p))
    ensure_source_unchanged(src, sha, stat, "source")
    assert calls == [], "the status taken when it was hashed vouches for the bytes"
    src.write_text('{"text": "b"}\n')  # same size, new bytes: the status moved, so it is hashed and refused
    os.utime(src, ns=(stat[0][2], stat[0][2]))  # even with the mtime set back (the ctime cannot be)
    with pytest.raises(JobError, match="changed after the request was accepted"):
        ensure_source_unchanged(src, sha, stat, "source")
    assert calls == [src]
    src.unlink()
    with pytest.raises(JobError, match="disappeared"):
        ensure_source_unchanged(src, sha, stat, "source")


def test_tokenizer_cache_fingerprints_once_per_version_of_the_files(tmp_path, monkeypatch):
    import pf_trl.data.tokenizer as tk

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    loads, prints = [], []

    class Tok:
        pass

    monkeypatch.setattr(tk, "tokenizer_fingerprint", lambda t: prints.append(t) or {"sha256": str(len(prints))})
    cache = tk.TokenizerCache(loader=lambda name: loads.append(name) or Tok())
    first = cache.get(str(folder))
    assert cache.fingerprint(str(folder)) == cache.fingerprint(str(folder)) == {"sha256": "1"}
    assert cache.get(str(folder)) is first and len(loads) == 1 and len(prints) == 1
    (folder / "tokenizer.json").write_text('{"changed": 1}')
    assert cache.get(str(folder)) is not first and len(loads) == 2
    assert cache.fingerprint(str(folder)) == {"sha256": "2"}
