"""Next states → rewards, hindsight hints and per-token advantages (binary, OPD, combined)."""
