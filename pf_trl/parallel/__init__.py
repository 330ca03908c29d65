"""Parallelism beyond data parallel: pf-trl's Ulysses sequence parallelism over packed rows, and the refusal of
every parallelism setting pf-trl cannot keep exact."""

from pf_trl.parallel.checks import check_launch, check_parallelism
from pf_trl.parallel.ulysses import ParallelismError, SequenceParallelError, SequenceParallelGroup

__all__ = ["ParallelismError", "SequenceParallelError", "SequenceParallelGroup", "check_launch",
           "check_parallelism"]
