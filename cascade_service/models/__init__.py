"""Model adapters: the only layer that imports transformers (a test enforces it)."""
