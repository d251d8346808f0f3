"""rlyard rollout-orchestrator: owns RL runs (tasks, episodes, rewards, batches, weight sync, run API)."""
