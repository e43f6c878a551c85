"""`cascade-service bench`: our cascade and transformers' decoders, timed side by side in one process.

Layout: `methods` (method names become runner objects), `zoo` (every tier loaded once, shared),
`harness` (interleaved timing loop and figures), `report` (results.md and plots), `cli`.
transformers itself is called only from `cascade_service.zoo.baselines`.
"""
