"""Throughput of `pf-trl pretokenize --engine ray` (1 and 2 Ray workers) vs the single-process engine, and a
projection to 8 nodes from the measured per-worker rate.

The same source (``--rows`` short prompt/completion rows, generated, ~20-40 tokens each) and the same flags for every
engine; each run is the whole call (source read, tokenized, parts written with their manifests, the dataset
manifest last), from a cold output directory. The Ray cluster is a local one started here (``ray.init`` with 2 CPUs,
a 200 MB object store), its start-up excluded; the first Ray run of each worker count is preceded by nothing else,
so worker start-up (import pf-trl, load the tokenizer) is inside the time, as in a real job. Runs are interleaved
(local, ray-1, ray-2, local, ...) and the median of ``--trials`` kept. Every run's rows are checked equal to the
single-process engine's first run (same count and token total).

Where the gain comes from: Ray splits the rows into parts tokenized by independent worker processes; on N idle
cores N workers approach N times one worker's rate, minus the driver's source parse and per-part overhead (a part's
``save_to_disk`` and checksums). On a busy machine the workers share cores with everything else: the measured
scaling then says little; the per-worker rate is what the projection uses.

Prints a table; writes ``benchmarks/results/ray_pretokenize.json``.

    python benchmarks/ray_pretokenize.py [--rows 1000000] [--trials 3] [--rows_per_part 50000]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def write_source(path: Path, rows: int) -> int:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": f"Question {i}: what is {i % 97} plus {i % 89}?\n",
                                "completion": f"The answer is {(i % 97) + (i % 89)}. " * (1 + i % 3)}) + "\n")
    return path.stat().st_size


def run_local(src: Path, out: Path) -> dict:
    from pf_trl import pretokenize

    t0 = time.perf_counter()
    m = pretokenize(src, out, progress=False)
    return {"seconds": time.perf_counter() - t0, "examples": m["counts"]["examples"], "tokens": m["counts"]["tokens"]}


def run_ray(src: Path, out: Path, workers: int, rows_per_part: int) -> dict:
    from pf_trl import pretokenize

    t0 = time.perf_counter()
    m = pretokenize(src, out, engine="ray", ray_workers=workers, rows_per_part=rows_per_part)
    return {"seconds": time.perf_counter() - t0, "examples": m["counts"]["examples"], "tokens": m["counts"]["tokens"],
            "parts": len(m["parts"])}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rows_per_part", type=int, default=50_000)
    ap.add_argument("--cores_per_node", type=int, default=32, help="for the 8-node projection")
    ap.add_argument("--bucket_mb_s", type=float, default=1000.0,
                    help="aggregate bucket write bandwidth assumed for the projection (MB/s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ray_pretokenize.json"))
    args = ap.parse_args()

    import ray

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")
    ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False,
             _temp_dir=temp, configure_logging=False)
    try:
        src = work / "rows.jsonl"
        source_bytes = write_source(src, args.rows)
        runs: dict[str, list[dict]] = {"single-process": [], "ray, 1 worker": [], "ray, 2 workers": []}
        reference = None
        out_bytes = 0
        for trial in range(args.trials):
            for name in runs:
                out = work / f"out-{trial}-{name.replace(' ', '').replace(',', '-')}"
                if name == "single-process":
                    r = run_local(src, out)
                else:
                    r = run_ray(src, out, 1 if "1 worker" in name else 2, args.rows_per_part)
                if reference is None:
                    reference = (r["examples"], r["tokens"])
                    out_bytes = dir_bytes(out)
                assert (r["examples"], r["tokens"]) == reference, f"{name}: other rows than the first run"
                runs[name].append(r)
                shutil.rmtree(out, ignore_errors=True)
                print(f"trial {trial} {name}: {r['seconds']:.1f} s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    examples, tokens = reference
    rows = []
    for name, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        rows.append({"engine": name, "seconds_median": round(seconds, 2), "seconds_runs": [round(r["seconds"], 2)
                                                                                          for r in rs],
                     "rows_per_s": round(args.rows / seconds), "tokens_per_s": round(tokens / seconds),
                     "parts": rs[0].get("parts", 1)})
    base = rows[0]["rows_per_s"]
    for r in rows:
        r["speed_vs_single_process"] = round(r["rows_per_s"] / base, 3)
    one, two = rows[1], rows[2]
    per_worker = one["rows_per_s"]
    scaling = two["rows_per_s"] / (2 * per_worker)
    bytes_per_row = out_bytes / examples
    workers_8 = 8 * args.cores_per_node
    cpu_bound = per_worker * workers_8
    io_bound = args.bucket_mb_s * 1e6 / bytes_per_row
    projection = {
        "nodes": 8, "cores_per_node": args.cores_per_node, "workers": workers_8,
        "per_worker_rows_per_s": per_worker, "per_worker_tokens_per_s": one["tokens_per_s"],
        "measured_2_worker_efficiency": round(scaling, 3),
        "cpu_bound_rows_per_s": round(cpu_bound),
        "output_bytes_per_row": round(bytes_per_row, 1),
        "assumed_bucket_mb_s": args.bucket_mb_s,
        "bandwidth_bound_rows_per_s": round(io_bound),
        "projected_rows_per_s": round(min(cpu_bound, io_bound)),
        "projected_tokens_per_s": round(min(cpu_bound, io_bound) * tokens / examples),
        "note": ("per-worker rate measured with 1 Ray worker on this machine, times 8 x cores_per_node workers "
                 "(linear: each part is independent; the driver's source parse and the final manifest are not "
                 "parallel and are not in this bound), capped by the assumed aggregate write bandwidth for the "
                 "parts' bytes; the 2-worker efficiency measured here is on a shared 2-core machine"),
    }
    report = {"benchmark": "ray_pretokenize", "rows": args.rows, "examples": examples, "tokens": tokens,
              "source_bytes": source_bytes, "output_bytes": out_bytes, "trials": args.trials,
              "rows_per_part": args.rows_per_part, "results": rows, "projection_8_nodes": projection,
              "environment": {"machine": platform.machine(), "cpus": os.cpu_count(),
                              "load_avg_at_end": os.getloadavg()[0], "python": platform.python_version(),
                              "ray": ray.__version__}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\n{args.rows} rows, {tokens} tokens; median of {args.trials} interleaved trials")
    print("| engine | seconds | rows/s | tokens/s | vs single-process |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {r['seconds_median']} | {r['rows_per_s']} | {r['tokens_per_s']} | "
              f"{r['speed_vs_single_process']}x |")
    print(f"8 nodes x {args.cores_per_node} cores: {projection['projected_rows_per_s']} rows/s projected (cpu bound "
          f"{projection['cpu_bound_rows_per_s']}, bandwidth bound {projection['bandwidth_bound_rows_per_s']})")


if __name__ == "__main__":
    main()
