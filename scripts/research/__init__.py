"""One-off research and measurement tools (``python -m scripts.research.X``)."""
