"""The drift study: what each verifier does to the sampling distribution, the speed and the task
(study, run, statistics, report, plots), and the same statistics over a training run's rollouts."""
