"""The package version, apart so that modules can read it without importing the root."""

__version__ = "0.1.0"
