"""pf-trl's development tools, for a checkout only (never in the wheel): the tiny-model builders for every
architecture transformers ships (:mod:`pf_trl_dev.tiny`, :mod:`pf_trl_dev.tiny_vlm`) and the coverage sweep that
measures pf-trl on each of them (``python -m pf_trl_dev.coverage --write``).

They import pf-trl (its trainer included); pf-trl never imports them. The tests, ``scripts/`` and ``benchmarks/`` run
from the repository root, which puts this package on ``sys.path`` (pytest: ``pythonpath`` in ``pyproject.toml``; a
benchmark script: the root inserted by the script).
"""
