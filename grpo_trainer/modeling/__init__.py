"""What touches a model: log-prob forwards (`logprobs`; padded or packed, `forwards` and `packing`), the float32 CPU
kernel choice (`kernels`), replaying a rollout's layer outputs in the loss forward (`replay`), one LoRA merge rule
(`lora`), the policy's weights as an inference engine loads them (`export`), and unwrapping DDP / DeepSpeed / PEFT
(`unwrap`)."""
