"""The reconfigure bench reads the old group leaders' pre-copy log lines (services/worker/migration_flows.py)."""

from nitsum_load.reconfigure_core import precopy_stats

LINES = [
    "2026-11-30 07:56:30,1 INFO [decode-worker] nitsum.worker.migration: epoch 1: prepare step 114.6 ms (allocated 21, "
    "exchanged 63), then pre-copy of 3 flow(s) + 1 local copy(ies), 4 chunk(s), 458752 bytes, done 94.6 ms after the "
    "pending prepare ack (permits 19.5 ms)",
    "2026-11-30 07:56:30,2 INFO [decode-worker] nitsum.worker.migration: epoch 1: prepare step 80.0 ms (allocated 6), "
    "then pre-copy of 3 flow(s) + 1 local copy(ies), 5 chunk(s), 1000 bytes, done 120.5 ms after the pending prepare ack "
    "(permits 2.0 ms)",
    "2026-11-30 07:56:31,0 INFO [decode-worker] nitsum.worker.migration: epoch 2: prepare step 70.9 ms (), then pre-copy "
    "of 6 flow(s) + 2 local copy(ies), 8 chunk(s), 3997696 bytes, done 158.5 ms after the pending prepare ack (permits 3.2 ms)",
    "2026-11-30 07:56:31,5 INFO [coordinator] node node0: a -> b in 583.4 ms (pause 212.1 ms): admin set-topology",
]


def test_precopy_stats_per_epoch():
    assert precopy_stats(LINES) == {
        1: {"prepare_step_ms": 114.6, "flows": 6, "chunks": 9, "bytes": 459752, "precopy_ms": 120.5},
        2: {"prepare_step_ms": 70.9, "flows": 6, "chunks": 8, "bytes": 3997696, "precopy_ms": 158.5},
    }
