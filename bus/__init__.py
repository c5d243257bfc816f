"""bus package."""
