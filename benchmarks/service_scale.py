"""The service on a large source: rows/s end to end and the memory of each process, for ``--rows`` (5M) rows.

Generates a synthetic JSON Lines file of instruction rows with Alpaca-like lengths (prompt 5-30 words, response
10-80 words of English drawn from the shipped sample's vocabulary), starts a real ``pf-trl serve`` (1 worker,
``--num-proc``), POSTs the file and samples, every 0.5 s until the job ends, the RSS of the API process, of the
worker (with its tokenizer processes) and of the preflight sandboxes. Prints a table; writes
``benchmarks/results/service_scale.json``. Measured once (it takes tens of minutes on 2 cores).

    python benchmarks/service_scale.py [--rows 5000000] [--num-proc 2]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from test_service_support import Server, wait_state


def generate(path: Path, rows: int, seed: int = 0) -> int:
    """Rows of real English words (the shipped ShareGPT sample's vocabulary), Alpaca-like lengths."""
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    rng = random.Random(seed)
    text = SHAREGPT_SAMPLE.read_text(encoding="utf-8")
    vocab = sorted({w for w in text.replace("\\n", " ").split() if w.isalpha() and len(w) < 15})
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choices(vocab, k=rng.randint(5, 30)))
            response = " ".join(rng.choices(vocab, k=rng.randint(10, 80)))
            f.write(json.dumps({"prompt": f"### Instruction:\n{prompt}\n\n### Response:\n", "completion": response}))
            f.write("\n")
    return path.stat().st_size


class Sampler(threading.Thread):
    """Peak RSS by role: the API process, the worker tree, the preflight sandboxes."""

    def __init__(self, api_pid: int):
        super().__init__(daemon=True)
        self.api = psutil.Process(api_pid)
        self.peak = {"api": 0, "worker": 0, "preflight": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak["api"] = max(self.peak["api"], self.api.memory_info().rss)
                for child in self.api.children():
                    cmd = " ".join(child.cmdline())
                    role = "worker" if "preprocess_service.worker" in cmd else "preflight" if "preflight" in cmd else None
                    if role is None:
                        continue
                    rss = child.memory_info().rss + sum(c.memory_info().rss for c in child.children(recursive=True))
                    self.peak[role] = max(self.peak[role], rss)
            except psutil.Error:
                pass
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--tmp", default=os.environ.get("PF_BENCH_TMP"))
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="pf-scale-", dir=args.tmp))
    try:
        root = base / "data"
        root.mkdir()
        src = root / "rows.jsonl"
        t0 = time.time()
        size = generate(src, args.rows)
        print(f"generated {args.rows} rows, {size / 1e9:.2f} GB in {time.time() - t0:.0f}s", flush=True)
        server = Server(base / "cache", [root], args=["--num-proc", str(args.num_proc)]).start(timeout=300)
        sampler = Sampler(server.proc.pid)
        sampler.start()
        try:
            with httpx.Client(base_url=server.url, timeout=600) as c:
                t0 = time.time()
                r = c.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}, "options": {"max_seq_len": 1024}})
                post_s = time.time() - t0
                assert r.status_code == 202, r.text
                dataset_id = r.json()["id"]
                status = wait_state(c, dataset_id, timeout=6 * 3600, interval=2)
                total_s = time.time() - t0
        finally:
            sampler.stop.set()
            sampler.join()
            server.stop()
        assert status["state"] == "succeeded", status.get("error")
        m = status["manifest"]
        shards_gb = sum(e["bytes"] for e in m["checksums"]["files"].values()) / 1e9
        result = {
            "rows": args.rows, "source_gb": round(size / 1e9, 3), "num_proc": args.num_proc, "cores": os.cpu_count(),
            "post_s": round(post_s, 2), "post_to_succeeded_s": round(total_s, 1),
            "rows_per_s": round(args.rows / total_s, 1), "tokens": m["counts"]["tokens"],
            "tokens_per_s": round(m["counts"]["tokens"] / total_s, 1), "shards_gb": round(shards_gb, 3),
            "peak_rss_mib": {k: round(v / 2**20, 1) for k, v in sampler.peak.items()},
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=2))
    print("| rows | source | POST answer | POST -> succeeded | rows/s | tokens/s | API peak RSS | worker peak RSS "
          "(with its tokenizer processes) | preflight sandbox peak RSS |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    p = result["peak_rss_mib"]
    print(f"| {args.rows:,} | {result['source_gb']:.2f} GB | {result['post_s']:.1f} s | {total_s:.0f} s | "
          f"{result['rows_per_s']:,.0f} | {result['tokens_per_s']:,.0f} | {p['api']:.0f} MiB | {p['worker']:.0f} MiB | "
          f"{p['preflight']:.0f} MiB |")
    out = REPO / "benchmarks" / "results" / "service_scale.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
