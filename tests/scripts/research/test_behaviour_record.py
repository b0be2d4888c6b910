"""The behaviour record's digests: exact bits in, times out."""

import torch

from scripts.research.behaviour_record import digest, json_digest, timeless


def test_a_digest_changes_with_one_bit_and_with_the_dtype():
    x = torch.linspace(-1, 1, 17)
    y = x.clone()
    y.view(torch.int32)[5] ^= 1  # the last bit of one value
    assert digest(x) == digest(x.clone())
    assert digest(x) != digest(y)
    assert digest(x) != digest(x.double())


def test_times_speeds_and_hosts_are_left_out_and_nothing_else():
    row = {"step": 3, "loss": 0.25, "time_s": 1.5, "rollout_tok_s": 310.0, "peak_rss_mb": 900, "n_seqs": 4, "embed_norm": 1.0,
           "nested": {"kl": 0.01, "wall": 2.0}, "speedup_vs_lossless": 1.2, "out": "/tmp/a"}
    other = dict(row, time_s=9.9, rollout_tok_s=1.0, peak_rss_mb=1, nested={"kl": 0.01, "wall": 7.0}, speedup_vs_lossless=0.9, out="/tmp/b")
    assert timeless(row) == {"embed_norm": 1.0, "loss": 0.25, "n_seqs": 4, "nested": {"kl": 0.01}, "step": 3}
    assert json_digest([row]) == json_digest([other])
    assert json_digest([row]) != json_digest([dict(row, loss=0.26)])
