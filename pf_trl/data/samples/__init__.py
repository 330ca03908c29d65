"""Shipped sample data (see PROVENANCE.md)."""

from pathlib import Path

SHAREGPT_SAMPLE = Path(__file__).with_name("sharegpt_sample.jsonl")
