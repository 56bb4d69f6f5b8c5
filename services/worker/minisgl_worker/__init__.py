"""minisgl worker: the model, the paged KV cache, attention backends and the step engine."""
