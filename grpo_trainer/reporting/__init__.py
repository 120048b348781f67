"""What a run reports: metrics under TRL's names, the run log and plot, sampled completions, the Hub model card."""
