"""The package version, kept apart so that setup tools read it without importing torch."""

__version__ = "0.1.0"
