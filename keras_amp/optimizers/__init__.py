"""Loss-scale optimizers."""
