"""The fast rollout backend: a hand-written Llama-family decode loop over the model's own weights."""
