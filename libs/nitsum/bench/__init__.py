"""The benchmarks behind `nitsum bench` and the scripted runs tests and benchmarks start as processes
(`python -m nitsum.bench.node_run`, `tp_run`, `testbed` with its flow sender `flow_tcp`). Never imported by services or library packages.
"""
