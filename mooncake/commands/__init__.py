"""Sub-command groups of the `mooncake` CLI (each imports its heavy parts lazily)."""
