"""Cost per GB of verifying shards with each candidate checksum: sha256, blake3, xxh3-128, crc32c.

Hashes one real shard file of about ``--gib`` GiB (the shipped sample pretokenized and repeated) with
:func:`pf_trl.data.integrity.file_digest`, the streaming reader that ``load_shards``, ``pf-trl verify`` and the
service use (4 MiB blocks into one buffer; RSS stays flat). Two conditions:

- ``cached``: the file is in the page cache (a shard read or verified recently: the usual case on a training node);
  algorithms are interleaved over ``--trials`` rounds and the best of each is kept (the machine is shared).
- ``cold``: the file's pages are dropped first (``posix_fadvise(DONTNEED)`` on that file only), so the read
  comes from the disk; interleaved too, best of ``--trials``.

Prints a table of seconds per GB and GB/s; writes ``benchmarks/results/shard_checksum.json``.

    python benchmarks/shard_checksum.py [--gib 1] [--trials 3]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from pf_trl.data.integrity import HASHERS, file_digest


def make_shard(where: Path, gib: float) -> Path:
    """A real Arrow shard: the shipped sample pretokenized, its rows repeated up to ``gib`` GiB."""
    import datasets

    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    pretokenize(SHAREGPT_SAMPLE, where / "sample", progress=False)
    one = datasets.load_from_disk(str(where / "sample"))
    per_copy = sum(f.stat().st_size for f in (where / "sample").glob("*.arrow"))
    copies = max(1, round(gib * 2**30 / per_copy))
    big = datasets.concatenate_datasets([one] * copies)
    big.save_to_disk(str(where / "big"), max_shard_size=f"{int(gib * 1024 * 2)}MB")
    return next((where / "big").glob("*.arrow"))


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(path: Path, algorithm: str) -> float:
    t0 = time.perf_counter()
    file_digest(path, algorithm)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    import psutil

    algorithms = list(HASHERS)
    with tempfile.TemporaryDirectory(prefix="pf-checksum-", dir=os.environ.get("PF_BENCH_TMP")) as tmp:
        shard = make_shard(Path(tmp), args.gib)
        gb = shard.stat().st_size / 1e9
        for a in algorithms:  # warm the page cache and the imports
            file_digest(shard, a)
        rss_before = psutil.Process().memory_info().rss
        cached = {a: [] for a in algorithms}
        for _ in range(args.trials):
            for a in algorithms:
                cached[a].append(timed(shard, a))
        rss_after = psutil.Process().memory_info().rss
        cold = {a: [] for a in algorithms}
        for _ in range(args.trials):
            for a in algorithms:
                drop_cache(shard)
                cold[a].append(timed(shard, a))
        load = os.getloadavg()
    rows = []
    for a in algorithms:
        best = min(cached[a])
        cold_best = min(cold[a])
        rows.append({"algorithm": a, "cached_s_per_gb": round(best / gb, 3), "cached_gb_per_s": round(gb / best, 2),
                     "cold_s_per_gb": round(cold_best / gb, 3), "cold_gb_per_s": round(gb / cold_best, 2),
                     "cached_trials_s": [round(t, 3) for t in cached[a]], "cold_trials_s": [round(t, 3) for t in cold[a]]})
    print(f"shard: {gb:.2f} GB; RSS change while hashing: {(rss_after - rss_before) / 2**20:+.1f} MiB; "
          f"load average {load[0]:.1f} on {os.cpu_count()} cores")
    print("| algorithm | page cache: s/GB | GB/s | cold: s/GB | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['algorithm']} | {r['cached_s_per_gb']:.3f} | {r['cached_gb_per_s']:.2f} | "
              f"{r['cold_s_per_gb']:.3f} | {r['cold_gb_per_s']:.2f} |")
    out = REPO / "benchmarks" / "results" / "shard_checksum.json"
    out.write_text(json.dumps({"shard_gb": round(gb, 3), "trials": args.trials, "cpu": platform.processor() or
                               platform.machine(), "cores": os.cpu_count(), "load_average_1m": round(load[0], 1), "rss_change_mib":
                               round((rss_after - rss_before) / 2**20, 1), "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
