"""nitsum flow_scheduler service."""
