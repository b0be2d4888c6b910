"""``scripts/research/measure_ceiling.py``: per-step token and joint overlaps of a head over answers sampled
at T = 1, and the tau estimate and ceiling they give."""

import pytest
import torch

from scripts.research.measure_ceiling import main, measure
from tests.trainers.drafter.test_drafter import V, make_head, tiny_target
from trainers.drafter.data import generate_batch, records_to_data
from trainers.drafter.ttt import estimated_tau, ttt_acceptance


def _sampled_data(target, n: int = 10, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (6,), generator=g).tolist() for _ in range(n)]
    recs = generate_batch(target, prompts, [False] * n, max_new_tokens=14, eos_id=2, gen=g)
    return records_to_data(recs, [len(p) for p in prompts], ["bench"] * n)


def test_overlaps_tau_and_ceiling():
    target = tiny_target(layers=4, init_range=0.2)
    data = _sampled_data(target)
    head = make_head(target, data).eval()
    out = measure(head, data, 4, batch_size=3)
    assert out["k"] == 4 and len(out["token"]) == len(out["joint"]) == 4
    # the first step's joint overlap is the per-token one; later ones are joint laws, not products
    assert out["joint"][0] == pytest.approx(out["token"][0], abs=1e-6)
    assert all(0 < j <= 1 for j in out["joint"]) and out["joint"][3] < out["joint"][0]
    assert out["ceiling"] == pytest.approx(1 + sum(out["joint"]))
    assert out["tau_token"] == pytest.approx(estimated_tau(out["token"]))
    # the sums do not depend on how the answers are batched (to float32 rounding)
    again = measure(head, data, 4, batch_size=len(data))
    for key in ("token", "joint"):
        assert again[key] == pytest.approx(out[key], abs=1e-6)
    from trainers.drafter.data import collate

    whole = ttt_acceptance(head, collate(data, list(range(len(data)))), 4, (head.cfg.logit_scale,), block=True)
    assert out["positions"] == int(whole["count"][0])
    assert out["joint"][1] == pytest.approx(float(whole["acc_block"][0, 1] / whole["count_block"][1]), abs=1e-6)


@pytest.mark.parametrize("argv, words", [(["--k", "0"], "--k must be >= 1"),
                                         (["--samples", "0"], "--samples must be >= 1"),
                                         (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1")])
def test_bad_arguments_say_what_is_wrong(argv, words):
    with pytest.raises(SystemExit, match=words):
        main(argv)
