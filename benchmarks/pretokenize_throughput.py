"""Throughput of the service's tokenization pipeline vs a plain ``tokenizer(batch)`` loop.

Rows/s and tokens/s, on the same data (the shipped ShareGPT sample, repeated ``--repeat`` times) and the
same cores, with 1 and 2 processes:

- ``plain loop``: ``tokenizer(texts[i:i+256])`` over prompt+completion strings already in memory,
  returning only token counts (the most favourable baseline: no file reading, no labels, no writing).
  2 processes: a warmed-up spawn ``multiprocessing.Pool``, each tokenizing half.
- ``pretokenize()``: the function exactly as a service worker calls it (preloaded tokenizer,
  ``num_proc``, a progress callback), from the JSONL file to a complete shards directory on disk.
- ``service end-to-end``: ``POST /v1/datasets`` -> state ``succeeded`` observed by polling every 50 ms,
  against a running ``pf-trl serve --workers 1 --num-proc N`` on 127.0.0.1 (server start-up excluded).

``TOKENIZERS_PARALLELISM=false`` throughout, so "N processes" means N cores' worth of work everywhere. Trials are
interleaved (plain, pretokenize, service, plain, ...) and the best of each pipeline is kept.
Prints a markdown table; writes ``benchmarks/results/pretokenize_throughput.json``.

    python benchmarks/pretokenize_throughput.py [--repeat 4] [--trials 2] [--procs 1 2]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

_TOK = None


def _init_worker() -> None:
    global _TOK
    from pf_trl.data.tokenizer import load_tokenizer

    _TOK = load_tokenizer()


def _count_tokens(texts: list[str]) -> int:
    total = 0
    for i in range(0, len(texts), 256):
        total += sum(len(ids) for ids in _TOK(texts[i:i + 256])["input_ids"])
    return total


def plain_loop(texts: list[str], procs: int, pool=None) -> tuple[float, int]:
    t0 = time.perf_counter()
    if procs == 1:
        tokens = _count_tokens(texts)
    else:
        step = -(-len(texts) // procs)
        tokens = sum(pool.map(_count_tokens, [texts[i:i + step] for i in range(0, len(texts), step)]))
    return time.perf_counter() - t0, tokens


def run_pretokenize(src: Path, work: Path, procs: int, tok) -> tuple[float, int]:
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    out = work / f"pt-{procs}-{time.time_ns()}"
    calls = []
    t0 = time.perf_counter()
    manifest = pretokenize(src, out, PretokenizeConfig(), tokenizer=tok, num_proc=procs, progress=False,
                           progress_callback=lambda r, t, k: calls.append(r))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return elapsed, manifest["counts"]["tokens"]


def run_service(src: Path, work: Path, procs: int) -> tuple[float, int]:
    import httpx

    from test_service_support import Server, wait_state

    cache = work / f"svc-{procs}-{time.time_ns()}"  # a fresh cache: content addressing would make a rerun free
    server = Server(cache, [src.parent], args=["--workers", "1", "--num-proc", str(procs)]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            t0 = time.perf_counter()
            r = c.post("/v1/datasets", json={"source": {"path": src.name}})
            assert r.status_code == 202, r.text
            dataset_id = r.json()["id"]
            status = wait_state(c, dataset_id, timeout=3600, interval=0.05)
            elapsed = time.perf_counter() - t0
            assert status["state"] == "succeeded", status
            return elapsed, status["manifest"]["counts"]["tokens"]
    finally:
        server.stop()


PIPELINES = ("plain tokenizer(batch) loop", "pretokenize() as the service runs it",
             "service end-to-end (POST -> succeeded)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=4, help="copies of the 2,500-row sample (default 4)")
    parser.add_argument("--trials", type=int, default=2, help="interleaved trials; best of N per pipeline (default 2)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-service", action="store_true", help="skip the end-to-end service runs")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pretokenize_throughput.json"))
    args = parser.parse_args(argv)

    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="pf-bench-"))
    try:
        data = work / "data"
        data.mkdir()
        src = data / f"sharegpt_x{args.repeat}.jsonl"
        raw = SHAREGPT_SAMPLE.read_bytes()
        raw = raw if raw.endswith(b"\n") else raw + b"\n"
        src.write_bytes(raw * args.repeat)
        rows = [json.loads(line) for line in raw.decode().split("\n") if line.strip()] * args.repeat
        texts = [r["prompt"] + r["completion"] for r in rows]
        n = len(texts)
        _init_worker()
        tok = load_tokenizer()
        table = []
        for procs in args.procs:
            pool = mp.get_context("spawn").Pool(procs, initializer=_init_worker) if procs > 1 else None
            if pool is not None:
                pool.map(_count_tokens, [texts[:8]] * procs)  # warm: spawn + tokenizer load not timed
            # Interleaved trials (plain, pretokenize, service, plain, ...), best of each: the machine's load
            # drifts by tens of percent over a minute, so back-to-back blocks would compare different loads.
            runs: dict[str, list[tuple[float, int]]] = {name: [] for name in PIPELINES}
            for _ in range(args.trials):
                runs[PIPELINES[0]].append(plain_loop(texts, procs, pool))
                runs[PIPELINES[1]].append(run_pretokenize(src, work, procs, tok))
                if not args.no_service:
                    runs[PIPELINES[2]].append(run_service(src, work, procs))
            if pool is not None:
                pool.close()
                pool.join()
            entries = [(name, min(r)) for name, r in runs.items() if r]
            plain = entries[0][1]
            for name, (seconds, tokens) in entries:
                table.append({"pipeline": name, "processes": procs, "rows": n, "tokens": tokens,
                              "seconds": round(seconds, 3), "rows_per_s": round(n / seconds, 1),
                              "tokens_per_s": round(tokens / seconds, 1),
                              "vs_plain_loop": round(plain[0] / seconds, 3)})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{n} rows (ShareGPT sample x{args.repeat}), best of {args.trials}, TOKENIZERS_PARALLELISM=false, "
          f"{os.cpu_count()} cores\n")
    print("| pipeline | procs | seconds | rows/s | tokens/s | vs plain loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['pipeline']} | {r['processes']} | {r['seconds']:.2f} | {r['rows_per_s']:,.0f} | "
              f"{r['tokens_per_s']:,.0f} | {r['vs_plain_loop']:.2f}x |")
    result = {"created_unix": round(time.time(), 3), "machine": {"cpu_count": os.cpu_count(),
              "platform": platform.platform(), "python": platform.python_version()},
              "data": {"source": "pf_trl.data.samples.SHAREGPT_SAMPLE", "repeat": args.repeat, "rows": n},
              "trials": args.trials, "trial_order": "interleaved", "target_vs_plain_loop": 0.8,
              "note": "compare rows/s: the plain loop counts every token of prompt+completion, pretokenize and the "
                      "service count the tokens kept in the shards (max_seq_len 1024 truncation, no-loss rows dropped); "
                      "vs_plain_loop is the ratio of wall times on the same rows and processes",
              "results": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
