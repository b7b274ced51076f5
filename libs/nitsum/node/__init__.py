"""The node runtime: one node world, its topology and epochs, TP/role transitions, KV paths, runner pool.

Built on `nitsum.engine` (which imports nothing from here). Importing the package is cheap; torch loads
only when a module below is imported.
"""
