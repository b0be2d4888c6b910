"""Rollouts with exact behaviour log-probs. The interface is at the top of the package:

- ``backend``: the :class:`~rollout.backend.RolloutBackend` protocol, the one backend registry
  ``BACKENDS`` (``hf``, ``vllm``) and ``build_backend`` from a picklable ``WorkerSpec``;
- ``params`` (sampling, speculation and verifier configs), ``outputs`` (``RolloutBatch``, the one
  shape that leaves a backend), ``config`` (``ConfigError``);
- ``models`` (the target: ``TargetModel``, ``load_target``) and ``architectures`` (the families
  it reproduces exactly; others are refused by name);
- ``eagle3``, ``eagle3_head``, ``eagle3_io`` (the EAGLE-3 draft head and its files), ``chat``;
- ``options`` (``EngineOptions``: how the ``hf`` engine runs its forwards, passed to ``Engine``).

The engines and their parts, by job: ``rollout.engine`` (the ``hf`` engine), ``rollout.kernels``
(its native CPU kernels), ``rollout.ray`` (Ray actors), ``rollout.vllm`` (the ``vllm`` backend).
"""


def _check_import_names() -> None:
    """Refuse an environment where another distribution installs a package named ``verifiers``,
    ``rollout`` or ``scripts`` (``verifiers/name_clash.py``). The file is run by its path: where
    another ``verifiers`` shadows ours, importing the package would run that one (and load torch)."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "verifiers" / "name_clash.py"
    runpy.run_path(str(path), run_name="verifiers.name_clash")["check_import_names"]()


_check_import_names()
