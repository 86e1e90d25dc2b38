"""Training drafters for a target: `specdec train draft` (distilled draft model)."""
