"""Steady-state training benchmarks: synchronized per-step timing, recomputable summaries, bench row shapes."""
