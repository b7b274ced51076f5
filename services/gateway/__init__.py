"""nitsum gateway service."""
