"""What a node-world worker refuses at boot, before it joins any rendezvous."""

import pytest

from nitsum.config import ConfigError, WorkerConfig, load
from nitsum_services.worker.boot import build_backend


def test_a_node_world_needs_min_tp_1():
    config = load(WorkerConfig, [], {"NITSUM_NODE_SIZE": "4", "NITSUM_MIN_TP": "2"})
    with pytest.raises(ConfigError, match="NITSUM_MIN_TP=2: a node world's workers boot at TP=1"):
        build_backend(config, "hybrid")
