"""nitsum worker service."""
