"""The fast rollout backends: a hand-written Llama-family decoder over the model's own weights (guarded and
self-checked), and the model's own forward over the same shared-prefix cache for other architectures."""
