"""Our speculative rollouts inside TRL's GRPOTrainer (TRL >= 1.16, < 1.17).

``SpeculativeGRPOTrainer`` (trainer.py) is the entry point; ``SpeculativeRollouts``
(rollouts.py) is the ``rollout_func`` it installs, usable on its own.
"""

from trainers.trl.rollouts import RolloutSettings, SpeculativeRollouts, sampling_from_trl, tokenize_prompts
from trainers.trl.trainer import CORRECTION_TO_TRL, SpeculativeGRPOTrainer, trl_correction

__all__ = ["CORRECTION_TO_TRL", "RolloutSettings", "SpeculativeGRPOTrainer", "SpeculativeRollouts",
           "sampling_from_trl", "tokenize_prompts", "trl_correction"]
