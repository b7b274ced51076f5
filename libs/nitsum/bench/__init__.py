"""The benchmarks behind `nitsum bench` and the scripted runs tests and benchmarks start as processes
(`python -m nitsum.bench.node_run`, `tp_run`, `testbed`). Never imported by services or library packages.
"""
