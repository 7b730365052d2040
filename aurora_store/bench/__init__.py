"""Benchmark programs: each prints a table (or one JSON object with --json)."""
