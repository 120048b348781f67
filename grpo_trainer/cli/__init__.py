"""`grpo-train`: the command line, and the offline toy model and task of its demo (`toy`)."""

from grpo_trainer.cli.entry import main

__all__ = ["main"]
