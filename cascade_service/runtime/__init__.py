"""The composition root: one way for every wiring (the in-process engine, the standalone server, the Ray
app, tier servers) to assemble a coordinator and its session store from the config over an engine
core's tiers (`assemble`; the engine core itself is engine.core)."""
