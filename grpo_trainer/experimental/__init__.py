"""Import paths of TRL's experimental trainers, served by this package's one `GRPOTrainer`."""
