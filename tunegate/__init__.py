"""tunegate: evidence-gated release of tuned inference engines (shared core)."""

__version__ = "0.1.0"
