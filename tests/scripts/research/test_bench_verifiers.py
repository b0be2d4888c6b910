"""The verifier benchmark's bookkeeping on a small vocabulary (the figures themselves come
from running the script at V = 49152)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(autouse=True)
def chain_backend():  # the script picks the backends itself
    yield None


def test_bench_verifiers_times_both_backends_side_by_side(tmp_path, capsys):
    import torch

    from scripts.research.bench_verifiers import RULES, main

    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        result = main(["--threads", "1", "--batch", "2", "--nodes", "3", "--vocab", "600", "--repeats", "2",
                       "--no-model", "--backend", "native,torch", "--json", str(out), "--malloc", "default"])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["rows"] == result["rows"]
    for rows, size_key, size in ((result["rows"], "B", 2), (result["node_rows"], "N", 3)):
        assert len(rows) == 2 * len(RULES)
        assert {r["backend"] for r in rows} == {"native", "torch"}
        for r in rows:
            assert r[size_key] == size and r["verify_ms"] > 0
            assert r["ratio"] == pytest.approx(r["verify_ms"] / r["softmax_ms"])
    # the two backends verify the same inputs with the same seeds: the same outcomes
    for rows, stat in ((result["rows"], "mean_emitted"), (result["node_rows"], "accepted")):
        by = {(r["backend"], r["rule"]): r[stat] for r in rows}
        assert all(by[("native", rule)] == by[("torch", rule)] for _, rule in by)
    printed = capsys.readouterr().out
    assert "candidate verification (tree nodes)" in printed and "native" in printed
    with pytest.raises(SystemExit):
        main(["--backend", "gpu", "--no-model"])


def test_bench_verifiers_adds_the_law_test_rows(capsys):
    """``--test rule,law``: each rule once more with ``verify_chain(..., test="law")``, labelled;
    lossless's law rows are its own test (the same outcome)."""
    import torch

    from scripts.research.bench_verifiers import RULES, main

    threads = torch.get_num_threads()
    try:
        result = main(["--threads", "1", "--batch", "4", "--nodes", "--vocab", "600", "--repeats", "2",
                       "--no-model", "--test", "rule,law", "--malloc", "default"])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert len(rows) == 2 * len(RULES) and {r["test"] for r in rows} == {"rule", "law"}
    by = {r["rule"]: r["mean_emitted"] for r in rows}
    assert by["lossless [test=law]"] == by["lossless"]
    assert "mars(theta=0.9) [test=law]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--test", "best", "--no-model"])
