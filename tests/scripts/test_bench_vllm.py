"""``scripts/bench_vllm.py``'s rows of our own engine (``--hf-only``: what the script runs in the
main interpreter when the vLLM rows run in the vllm one); its vLLM rows need the vllm extra and
are run by hand (records in ``docs/measurements/``)."""

from __future__ import annotations

import json

import pytest

from scripts import bench_vllm


def test_our_rows_take_chain_lengths_verifier_specs_and_the_int8_head(tmp_path, monkeypatch):
    import rollout.kernels.quantize

    rounded = []
    real = rollout.kernels.quantize.quantize_int8_
    monkeypatch.setattr(rollout.kernels.quantize, "quantize_int8_", lambda head: rounded.append(head) or real(head))
    out = tmp_path / "rows.json"
    bench_vllm.main(["--hf-only", "--batch-sizes", "1", "--max-new-tokens", "6", "--hf-k", "2,3", "--int8-head",
                     "--hf-rules", "lossless:test=block;overshoot:lenience=0.3,min_p=0.1", "--json", str(out)])
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    specs = ("lossless:test=block", "overshoot:lenience=0.3,min_p=0.1")
    assert list(rows) == ["hf-plain"] + [f"hf-chain{k}-int8-{s}" for k in (2, 3) for s in specs]
    assert len(rounded) == 1  # the head the chain rows draft with was rounded to int8 weights
    assert rows["hf-plain"]["tau"] == 1.0
    for name, row in rows.items():
        assert row["batch"] == 1 and row["tokens"] > 0 and row["tok_s"] == pytest.approx(row["tokens"] / row["seconds"])
        if name != "hf-plain":
            assert 1.0 <= row["tau"] <= int(name[len("hf-chain")]) + 1  # at most K drafts and a bonus token a round


def test_our_rows_can_let_the_engine_decide_per_round(tmp_path, monkeypatch):
    from rollout.engine.engine import Engine

    specs, real = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, sampling, spec, *a, **k:
                        specs.append(spec) or real(self, prompts, sampling, spec, *a, **k))
    out = tmp_path / "rows.json"
    bench_vllm.main(["--hf-only", "--batch-sizes", "2", "--max-new-tokens", "6", "--hf-max-batch", "auto",
                     "--hf-rules", "lossless", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["config"] for r in rows] == ["hf-plain", "hf-chain3-mbauto-lossless"]
    assert all(r["batch"] == 2 and r["tokens"] > 0 for r in rows)
    chains = [s for s in specs if s.mode == "chain"]
    assert chains and all(s.max_batch == "auto" and s.adaptive_k and s.num_draft_tokens == 3 for s in chains)


def test_a_bad_verifier_spec_names_itself():
    with pytest.raises(SystemExit, match="lossless:test=nope"):
        bench_vllm.main(["--hf-only", "--batch-sizes", "1", "--max-new-tokens", "4", "--hf-rules", "lossless:test=nope"])


@pytest.mark.parametrize("flags, field", [(["--hf-k", "3,x"], "--hf-k"), (["--hf-k", "0"], "--hf-k"),
                                          (["--hf-max-batch", "some"], "--hf-max-batch")])
def test_bad_chain_lengths_and_caps_name_their_flag(flags, field, capsys):
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(flags)
    assert field in capsys.readouterr().err
