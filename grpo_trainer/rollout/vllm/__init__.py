"""vLLM as a rollout backend (`use_vllm=True`): an engine inside each training process (`vllm_mode='colocate'`) or
a separately started server (`vllm_mode='server'`, started with `grpo-train vllm-serve`).

Modules: `checks` (installation, version, platform and model checks, before anything is loaded), `sampling` (a
`GenerationConfig` as vLLM's sampling parameters; vLLM's outputs as a `Rollout`), `colocate` (the in-process
engine), `server` (the HTTP client and its weight transfer), `backend` (the `RolloutBackend` that ties them to the
trainer), `serve` (the server's command line). Nothing here imports vllm at import time: the package is optional.
See docs/VLLM.md.
"""
