"""What happens for each way data arrives (the rows of the data-arrival table in docs/data.md), on tiny models.

Each row tries what a user does (a stream as ``train_dataset``, several files, a concatenation of two formats, shards
of another tokenizer passed as a ``Dataset``, half an epoch, an eval subset...) and records the outcome: the metric
that shows it worked, or the first line of the error. ``benchmarks/results/data_arrivals_before.json`` holds the
same rows run before mixtures, streams and the identity check existed (with the flags of that time).

    python benchmarks/data_arrivals.py [--out benchmarks/results/data_arrivals.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
TINY_FLAG = ",".join(f"{k}={v}" for k, v in TINY.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/data_arrivals.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("PF_TRL_CACHE", tempfile.mkdtemp(prefix="pf-arrivals-cache-"))
    import datasets
    import numpy as np

    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    from data_paths import rows_per_format

    tok = load_tokenizer()
    work = Path(tempfile.mkdtemp(prefix="pf-arrivals-"))
    rows = rows_per_format(48)

    def jsonl(name, items):
        path = work / name
        path.write_text("".join(json.dumps(r) + "\n" for r in items))
        return path

    a, s, m = jsonl("alpaca.jsonl", rows["alpaca"]), jsonl("sharegpt.jsonl", rows["sharegpt"]), jsonl(
        "messages.jsonl", rows["messages"])

    def config(**kw):
        base = dict(output_dir=str(work / "out"), report_to=[], disable_tqdm=True, use_cpu=True, max_length=512,
                    save_strategy="no", logging_steps=1000, max_tokens_per_batch=2048)
        base.update(kw)
        return PaddingFreeConfig(**base)

    def trainer(train, **kw):
        eval_dataset = kw.pop("eval_dataset", None)
        return PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", seed=0, **TINY), args=config(**kw),
                                     train_dataset=train, eval_dataset=eval_dataset, processing_class=tok)

    def stream(path):
        return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)

    def fill(t, metrics):
        return round(metrics["train_real_tokens"] / (t.state.global_step * t.pf_token_budget), 4)

    res: dict[str, str] = {}

    def row(name, fn):
        try:
            res[name] = "OK: " + str(fn())
        except BaseException as exc:  # the outcome is what is recorded
            res[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
        print(f"{name} -> {res[name]}", flush=True)

    def r1():
        t = trainer(stream(a), max_steps=2)
        mt = t.train().metrics
        return {"padding_share": mt["train_padding_share"], "fill": fill(t, mt)}

    row("1 raw IterableDataset", r1)
    shards = work / "shards"
    pretokenize(a, shards, progress=False, tokenizer=tok)

    def r2():
        t = trainer(load_shards(shards).to_iterable_dataset(), max_steps=2)
        mt = t.train().metrics
        return {"padding_share": mt["train_padding_share"], "fill": fill(t, mt)}

    row("2 shards to_iterable_dataset", r2)

    def r3():
        t = trainer(str(a), eval_dataset=stream(a), max_steps=2, eval_strategy="steps", eval_steps=1)
        t.train()
        return {"eval_loss": round(t.evaluate()["eval_loss"], 4), "eval_rows": t.eval_dataset.num_rows}

    row("3 streamed eval", r3)

    def r4():
        out = {}
        for mode in ("none", "internal"):
            kw = dict(per_device_train_batch_size=4, max_tokens_per_batch=None) if mode == "none" else {}
            t = trainer(stream(a), max_steps=3, padding_free_mode=mode, **kw)
            out[mode] = t.train().metrics["train_padding_share"]
        return {"padding_share_padded": out["none"], "padding_share_padding_free": out["internal"]}

    row("4 padding_free none vs padding-free on the stream", r4)
    (work / "mix.yaml").write_text(
        "dataprocessor: {type: default, seed: 42}\ndatasets:\n"
        f"  - {{name: alpaca, sampling: 0.5, data_paths: [{a}]}}\n"
        f"  - {{name: sharegpt, sampling: 0.3, data_paths: [{s}]}}\n"
        f"  - {{name: messages, sampling: 0.2, data_paths: [{m}]}}\n")

    def r5():
        proc = subprocess.run([sys.executable, "-m", "pf_trl.cli.main", "train", "--data_config", str(work / "mix.yaml"),
                               "--output_dir", str(work / "o5"), "--model_overrides", TINY_FLAG, "--max_steps", "1",
                               "--max_tokens_per_batch", "2048", "--max_seq_len", "512", "--report_to", "none",
                               "--use_cpu", "True", "--save_strategy", "no", "--disable_tqdm", "True"],
                              capture_output=True, text=True)
        t = trainer([(str(a), 0.5), (str(s), 0.3), (str(m), 0.2)], num_train_epochs=1)
        t.get_train_dataloader()
        shares = [round(x["share_of_examples"], 3) for x in t._pf_train_sampler.stats()["sources"]]
        return {"cli_rc": proc.returncode, "api_epoch_shares": shares}

    row("5 several files / a mixture", r5)

    def r6():
        mixed = datasets.concatenate_datasets([datasets.Dataset.from_list(rows["alpaca"]),
                                               datasets.Dataset.from_list(rows["sharegpt"])])
        trainer(mixed, max_steps=1)
        return "constructed"

    row("6 concatenate alpaca+sharegpt", r6)

    def r7():
        parts = work / "parts"
        parts.mkdir()
        pretokenize(a, parts / "part-0", progress=False, tokenizer=tok)
        pretokenize(s, parts / "part-1", progress=False, tokenizer=tok)
        root = Path(__file__).resolve().parents[1]
        proc = subprocess.run([sys.executable, str(root / "k8s/scripts/merge_shards.py"), str(parts),
                               str(work / "merged")], capture_output=True, text=True)
        manifest = json.loads((work / "merged" / "pf_manifest.json").read_text())
        return {"rc": proc.returncode, "input_format": manifest["source"]["input_format"],
                "parts": [(p["name"], p["input_format"], p["rows"]) for p in manifest.get("sources", [])]}

    row("7 k8s merge alpaca+sharegpt", r7)

    def r8():
        other = load_tokenizer()
        other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        pretokenize(m, work / "other", progress=False, tokenizer=other)
        out = []
        ways = [("load_shards", lambda: load_shards(work / "other")),
                ("load_from_disk", lambda: datasets.load_from_disk(str(work / "other"))),
                ("concat", lambda: datasets.concatenate_datasets([datasets.load_from_disk(str(shards)),
                                                                  datasets.load_from_disk(str(work / "other"))]))]
        for name, make in ways:
            try:
                trainer(make(), max_steps=1)
                out.append(f"{name}: accepted")
            except ValueError as exc:
                out.append(f"{name}: refused ({str(exc)[:70]}...)")
        return out

    row("8 other tokenizer as Dataset", r8)

    def r9():
        big = datasets.Dataset.from_list(rows_per_format(200)["alpaca"])
        seen = []

        class Counting(PaddingFreeSFTTrainer):
            def compute_loss(self, model, inputs, *a, **k):
                if self.model.training:
                    seen.append((int((inputs["position_ids"] == 0).sum()), int(inputs["input_ids"].numel())))
                return super().compute_loss(model, inputs, *a, **k)

        t = Counting(build_model("pf-trl/tiny-llama", seed=0, **TINY), args=config(num_train_epochs=0.5),
                     train_dataset=big, processing_class=tok)
        mt = t.train().metrics
        ds = t.train_dataset
        return {"examples_share": round(sum(x for x, _ in seen) / ds.num_rows, 3),
                "tokens_share": round(sum(y for _, y in seen) / int(np.sum(ds["length"])), 3),
                "train_examples": mt.get("train_examples")}

    row("9 num_train_epochs 0.5", r9)

    def r10():
        t = trainer(str(a), eval_dataset=str(s), max_steps=1, eval_max_examples=10)
        first = t.eval_dataset["input_ids"]
        again = trainer(str(a), eval_dataset=str(s), max_steps=1, eval_max_examples=10, seed=1).eval_dataset
        return {"eval_rows": len(first), "same_examples_other_seed": first == again["input_ids"]}

    row("10 eval subset option", r10)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
