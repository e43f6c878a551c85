"""The composition root: a process's engine core (`core.EngineCore`: the only place a model is loaded),
and one way for every wiring (in-process engine, standalone server, Ray app, tier servers) to assemble
a coordinator and its session store from the config (`assemble`)."""
