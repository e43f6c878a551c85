"""The engine: where every request's work and every model's batched passes run, in one package.

- `core.EngineCore`: one per process that serves models. It loads each model once and joins it to its
  loop (`core.join_loop`), and holds what requests share (acceptance heads, statistical drafters'
  tables: `leaves`).
- `loop.TaskLoop`: the core's thread. A request runs there as a task (a greenlet) that parks on each
  forward pass it needs; `TaskLoop.step` is the engine's step: update (the ready tasks run until they
  park), schedule (each model's next batch), execute (one pass per batch, rows back to their tasks).
- `scheduler`: a model's queue of waiting passes and which of them make a batch (`take_batch`); the
  model's side of a pass (how a batch reads the KV caches) is models.batching, which never imports this.
- `clock`: what a task's time went to, and a model's fitted pass cost (`PassTimer`).
- `policies`: how much a request drafts each round (load adaptation, its trial, the floor), built by
  `policies.build_policies` for every wiring.
"""
