"""Training tasks: problems with exact answers (generated arithmetic, JSONL files) and their rewards."""
