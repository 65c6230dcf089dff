"""Benchmark scripts (run with torchrun / python -m); results land in benchmarks/results/."""
