"""Process groups for tensor parallelism."""

from nitsum.parallel.group import TPGroup, init_tp_group

__all__ = ["TPGroup", "init_tp_group"]
