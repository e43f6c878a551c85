"""Pure algorithm: stdlib + torch only (a test enforces it)."""
