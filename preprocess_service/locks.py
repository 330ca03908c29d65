"""One lock per key (a dataset id, a tokenizer name), created on first use, forgotten when many idle ones pile up."""

from __future__ import annotations

import threading


class KeyedLocks:
    def __init__(self, keep: int = 4096):
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._keep = keep

    def __call__(self, key: str) -> threading.Lock:
        with self._guard:
            if len(self._locks) > self._keep:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            return self._locks.setdefault(key, threading.Lock())
