"""rlyard trainer: algorithm-blind policy optimiser with checkpoints and weight sync to engines."""
