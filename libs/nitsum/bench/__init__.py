"""Benchmarks behind `nitsum bench` (never imported by services)."""
