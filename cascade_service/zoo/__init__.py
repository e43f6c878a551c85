"""Offline tooling for the models the project builds itself: the demo and tiny families (`build`,
`tiny`), their training (`train`), SpecDec++ acceptance heads (`train_head`) and the Hugging Face
baselines benchmarks compare against (`baselines`). Nothing here runs while serving."""
