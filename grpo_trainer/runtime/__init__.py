"""What training runs on: model loading and PEFT, multi-process set-up, checkpoints and signals."""
