"""tunegate sidecar: KServe v2 proxy in front of Triton that mirrors, compares, judges, promotes or pins."""
