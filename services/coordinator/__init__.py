"""nitsum coordinator service."""
