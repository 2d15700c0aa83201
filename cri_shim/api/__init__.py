"""The CRI's wire contract as Python modules, generated from protos/ by scripts/protos."""
