"""Benchmarks: each measures Headwater against a baseline in the same run on the same machine."""
