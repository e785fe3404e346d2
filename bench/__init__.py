"""Benchmarks: offline throughput on CPU, kernels and engine on GPU (results in BENCHMARKS.md)."""
