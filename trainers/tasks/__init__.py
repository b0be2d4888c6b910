"""Training tasks and prompt sets: problems with exact answers (generated arithmetic, JSONL
files) and their rewards, general instructions, and the held-out sets the benchmarks use."""
