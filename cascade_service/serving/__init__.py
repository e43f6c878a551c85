"""Ray Serve wiring: one deployment per model tier, a coordinator/ingress deployment, the app builder.

`tier.py` and `remote.py` are plain Python (no Ray import) so they are unit-testable; `app.py` wraps
them in deployments.
"""
