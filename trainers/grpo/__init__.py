"""GRPO training with off-policy correction: config, loss, correction, the loop and its run folder."""
