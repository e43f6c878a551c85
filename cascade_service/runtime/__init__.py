"""The composition root: where the wirings (in-process engine, standalone server, Ray app) assemble
a coordinator and its session store from the config, one way for all three."""
