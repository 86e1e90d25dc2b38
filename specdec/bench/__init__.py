"""Benchmarks: task sets and the side-by-side runner behind `specdec bench`."""
