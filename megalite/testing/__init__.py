"""Helpers for megalite's own tests and benchmarks (no pytest here): run a function on several
gloo processes, each with its own ParallelState."""

from megalite.testing.multiprocess import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
