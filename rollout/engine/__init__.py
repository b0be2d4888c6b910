"""The ``hf`` engine: our speculative decoding engine over a Hugging Face model.

:class:`rollout.engine.engine.Engine` runs the rounds (draft, verify, commit) over a
:class:`rollout.engine.sequences.SequenceTable` of rows with a per-row KV cache
(``kv_cache``), through the :class:`rollout.engine.runner.ModelRunner` (the target's and the
head's forwards), drafting chains and trees (``tree``, ``sampled_tree``) and choosing each
round's drafting with the ``planner`` from measured step costs (``timing``).
:class:`rollout.engine.backend.HFBackend` puts it behind the rollout interface
(``rollout.backend``); ``rollout.options.EngineOptions`` are its explicit A/B options. The native CPU
kernels it runs on are in :mod:`rollout.kernels`.
"""
