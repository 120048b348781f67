"""The `grpo-train` entry point: `grpo-train plan ...` (`cli.plan`), else training and `vllm-serve`
(`cli.command`)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from grpo_trainer.cli import plan

        raise SystemExit(plan.main(argv[1:]))
    from grpo_trainer.cli import command

    command.main(argv)
