"""tunegate tuner: accuracy-gated build-route search that writes versioned engines with release records."""
