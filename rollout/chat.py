"""Chat templating: a prompt through the tokenizer's chat template, as token ids.

Every prompt the project generates from (training, drift study, drafter data,
benchmarks, the TRL plug-in) is rendered here: the template with the generation prompt,
then tokenised without adding special tokens (the template already has them).
"""

from __future__ import annotations

from typing import Any


def chat_ids(tokenizer: Any, prompt: str | list[dict], *, system: str | None = None,
             **template_kwargs: Any) -> list[int]:
    """Token ids of ``prompt`` (a user message's text, or a list of chat messages) through the
    chat template, with the generation prompt; ``system`` prepends a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
