"""The keras_amp release, importable without importing the package."""

__version__ = "0.1.0"
