"""Helpers the test modules share (never imported from another test module)."""
