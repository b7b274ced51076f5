"""nitsum services: thin async shells over nitsum cores."""
