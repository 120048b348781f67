"""`python -m grpo_trainer.cli` (and `accelerate launch -m grpo_trainer.cli`) runs `grpo-train`."""

from grpo_trainer.cli.entry import main

main()
