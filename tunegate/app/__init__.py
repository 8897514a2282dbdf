"""The application layer: the `tunegate` command line, the demo, the canary report and the pytest plugin.

It stands on tuner/, sidecar/ and loadtest/, which stand on the ground layer (the rest of tunegate/); nothing
below imports it (import-linter contracts in pyproject.toml).
"""
