"""The lossy-verification training study: what a lossy verifier does to GRPO training, and what
the behaviour log-prob correction buys back.

Vocabulary:
- **setting**: one way of producing and correcting the rollouts: a verifier (or a truncation
  rule's matched baseline, ``rollout.truncation_sampling``) and a correction mode, over one base
  GRPO config (``train:`` of the study YAML).
- **run**: one setting at one seed, a normal GRPO run folder ``<out_dir>/runs/<setting>/seed<k>/``
  (``scripts.compare_runs`` reads it) plus its ``eval.jsonl``.
- **paired**: runs of one seed share the training problems and rollout seeds (both derive from
  ``run.seed``, ``trainers.grpo.loop``), and every run is evaluated on the same held-out problems
  with the same sampling seeds; differences between settings are taken per (seed, problem).
- **held-out evaluation**: the accuracy of the policy itself, sampled exactly (plain decoding,
  lossless, the full distribution at T = 0 and T = 1) on held-out problems that no training step
  sees, never through the run's own verifier (``trainers.study.evaluate``).
- **comparisons**: every setting against the **reference** (lossless); a corrected setting
  against the same rollouts uncorrected (what the correction buys back); a truncation rule
  against its matched baseline (truncation sampling without speculation).

``config`` holds the study YAML, ``grid`` the runs and comparisons, ``evaluate`` the held-out
evaluation, ``runner`` trains the grid (one after another or as Ray tasks, resumable), ``stats``
the statistics, ``report`` and ``plots`` the report (``study.md``, ``study.json``, ``plots/``).
"""
