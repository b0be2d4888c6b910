"""The user entry points, each ``python -m scripts.<name>`` and a console command (``pyproject.toml``):
train, train_trl, drift, study, train_drafter, measure_acceptance, compare_runs, check_model,
bench_rollout and bench_vllm (with their helpers bench_measure, bench_rows, bench_plot and cli).
The one-off research and measurement tools are in :mod:`scripts.research`."""
