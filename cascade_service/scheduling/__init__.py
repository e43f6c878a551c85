"""Scheduling above the algorithm: block policies that adapt to load (`load`, `trial`).

The cascade reaches them only through `core.policy.BlockPolicy`."""
