"""Float32-island layers."""
