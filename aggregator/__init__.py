"""aggregator package."""
