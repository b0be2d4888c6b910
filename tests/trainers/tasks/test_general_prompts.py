"""The held-out prompt sets (drafter training, measure_acceptance, the benchmarks)."""

from __future__ import annotations

from trainers.tasks.general import benchmark_prompts, heldout_prompts


def test_heldout_prompts_spread_over_difficulties_then_general():
    texts, kinds = heldout_prompts(5, (1, 2), seed=3, n_general=2)
    assert kinds == ["arithmetic"] * 5 + ["general"] * 2 and len(set(texts)) == 7
    again, _ = heldout_prompts(5, (1, 2), seed=3, n_general=2)
    assert again == texts
    assert heldout_prompts(4, (1, 2, 3), 1000)[0] == ["".join(t) for t in benchmark_prompts(_Plain(), 4, 0)]


class _Plain:
    """A tokenizer whose chat template is the text itself (to compare prompt texts)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        return messages[-1]["content"]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": text}
