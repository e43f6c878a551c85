"""The tier protocol across processes: its wire codec (`codec`) and the coordinator's view of a tier
that lives elsewhere (`remote`). Transport-agnostic: a Ray Serve handle or any call that carries bytes."""
