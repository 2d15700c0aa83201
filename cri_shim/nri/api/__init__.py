"""NRI's wire contract as Python modules, generated from protos/nri/ by scripts/protos."""
