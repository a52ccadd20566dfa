"""Shared code of the examples: data sets, model families, training with timing, float32 comparison.

Examples only use keras_amp's public API; this folder is not part of the installed package.
"""
