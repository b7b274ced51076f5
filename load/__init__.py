"""nitsum load generator, trace replay, reports and benchmarks."""
