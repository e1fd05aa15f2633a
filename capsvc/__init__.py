"""capsvc: stake-cap and sales-validation service for lottery Keno, backed by Redis."""

__version__ = "0.1.0"
