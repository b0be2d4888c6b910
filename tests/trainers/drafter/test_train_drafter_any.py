"""``scripts.train_drafter`` for a target given by its folder (a tiny Qwen2, not the embedded
SmolLM2) on a JSONL file of prompts and conversations: the exported head has the target's
shapes, feature layers and a draft vocabulary of its most frequent response tokens, and the
engine loads it and drafts with it losslessly. Also the prompt file's records and errors."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import yaml

from rollout.eagle3 import load_eagle3, read_eagle3_config
from rollout.engine.engine import Engine
from rollout.models import TargetConfig, load_target
from rollout.params import SamplingParams, SpecConfig
from tests.trainers.drafter.qwen_target import HIDDEN, LAYERS, VOCAB, save_tiny_qwen2
from trainers.drafter.prompts import PromptFileError, read_prompt_file, split_records

RECORDS = [
    {"prompt": "what is 2 + 3 ?"},
    {"prompt": "name a b c d"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say w1 w2 w3"}]},
    {"messages": [{"role": "user", "content": "count 1 2 3"}, {"role": "assistant", "content": "4 5"},
                  {"role": "user", "content": "more"}, {"role": "assistant", "content": "dropped"}], "kind": "chat"},
    {"prompt": "x y z w9 ?"},
    {"prompt": "7 * 8 = ?", "kind": "chat"},
]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" if isinstance(r, dict) else r for r in records))
    return str(path)


def write_config(path, tmp, **change) -> str:
    cfg = {"target": {"dtype": "float32"},
           "data": {"heldout_fraction": 0.34, "max_new_tokens": 10, "greedy_fraction": 0.5, "batch_size": 8,
                    "seed": 0, "cache_dir": str(tmp / "cache")},
           "draft_vocab_size": 100, "init": "lm_head", "ttt_steps": 3, "epochs": 3, "batch_size": 2,
           "lr": 3e-3, "warmup_steps": 1, "seed": 0, "out_dir": str(tmp / "run"), "save_every": 100,
           "eval_every": 100, "device": "cpu", "export_dtype": "float32", "threads": 1}
    cfg.update(change)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_train_drafter_on_a_folder_target_exports_a_head_the_engine_drafts_with(tmp_path):
    from scripts.train_drafter import data_path, main, with_overrides
    from trainers.drafter.data import DrafterData

    target_dir = save_tiny_qwen2(tmp_path / "qwen2")
    data = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    config = write_config(tmp_path / "drafter.yaml", tmp_path)
    out = tmp_path / "head"
    report = main(["--config", config, "--target", str(target_dir), "--data", data, "--export", str(out)])
    assert report["steps"] == 3 * 2 and set(report["heldout"]) <= {"file", "chat"}  # 4 train records, 2 held out

    raw = read_eagle3_config(out)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"],
            raw["intermediate_size"]) == (HIDDEN, 6, 2, 16, 192)  # the Qwen2 target's shapes
    assert (raw["vocab_size"], raw["draft_vocab_size"], raw["target_hidden_size"]) == (VOCAB, 100, HIDDEN)
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, LAYERS // 2, LAYERS - 3] and raw["rope_theta"] == 1e6

    target, _ = load_target(TargetConfig(path=str(target_dir)))
    head = load_eagle3(out, target)
    from rollout.config import from_dict, load_yaml
    from trainers.drafter.train import DrafterConfig

    args = argparse.Namespace(target=str(target_dir), data=data, aux_layer_ids=None)
    cfg = with_overrides(from_dict(DrafterConfig, load_yaml(config)), args)
    train = DrafterData(**torch.load(data_path(cfg), weights_only=True)["train"])
    counts = torch.bincount(train.response_tokens(), minlength=VOCAB)
    ids = head.target_ids  # d2t: the most frequent response tokens, sorted
    assert len(ids) == 100 and bool((ids[1:] > ids[:-1]).all())
    assert int(counts[ids].min()) >= int(counts[~head.t2d].max()) and int(counts[ids].min()) < int(counts[ids].max())
    assert int(head.t2d.sum()) == 100 and bool(head.t2d[ids].all())

    prompts = [[2, 5, 30, 41, 3, 2, 6], [2, 5, 17, 9, 3], [2, 5, 60, 61, 62, 63, 3, 2, 6]]
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=0, max_new_tokens=16)
    plain = engine.generate(prompts, sampling)
    for spec in (SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy"),
                 SpecConfig(mode="tree", depth=3, top_k=2, total_tokens=6)):
        res = engine.generate(prompts, sampling, spec, debug=True)
        assert [c.completion_ids for c in res.completions] == [c.completion_ids for c in plain.completions]
        drafted = torch.cat([d.candidates for d in res.debug if d.candidates is not None])
        drafted = drafted[drafted >= 0]
        assert len(drafted) > 0 and bool(head.t2d[drafted].all())


def test_aux_layer_ids_from_the_command_line_reach_the_head(tmp_path):
    from scripts.train_drafter import main

    target_dir = save_tiny_qwen2(tmp_path / "qwen2")
    data = write_jsonl(tmp_path / "prompts.jsonl", RECORDS[:3])
    config = write_config(tmp_path / "drafter.yaml", tmp_path, epochs=1, draft_vocab_size=500,
                          data={"heldout_fraction": 0.0, "max_new_tokens": 6, "cache_dir": str(tmp_path / "cache")})
    out = tmp_path / "head"
    report = main(["--config", config, "--target", str(target_dir), "--data", data, "--export", str(out),
                   "--aux-layer-ids", "1,3,6"])
    assert "heldout" not in report and "logit_scale" not in report  # nothing held out: no report, no calibration
    raw = read_eagle3_config(out)
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6] and raw["draft_vocab_size"] == VOCAB  # capped
    target, _ = load_target(TargetConfig(path=str(target_dir)))
    from rollout.eagle3 import HeadMismatchError

    with pytest.raises(HeadMismatchError, match=r"layers \(1, 3, 6\)"):
        load_eagle3(out, target)
    target.set_aux_layer_ids((1, 3, 6))
    head = load_eagle3(out, target)
    res = Engine(target, head, num_threads=1).generate([[2, 5, 30, 3]], SamplingParams(temperature=0, max_new_tokens=8),
                                                        SpecConfig(mode="chain", num_draft_tokens=2, draft_sampling="greedy"))
    assert len(res.completions[0].completion_ids) == 8
    with pytest.raises(SystemExit):
        main(["--config", config, "--target", str(target_dir), "--data", data, "--aux-layer-ids", "1,3,8"])


def test_a_bad_record_stops_training_naming_file_and_line(tmp_path, capsys):
    from scripts.train_drafter import main

    target_dir = save_tiny_qwen2(tmp_path / "qwen2")
    data = write_jsonl(tmp_path / "prompts.jsonl", RECORDS[:2] + ["\n", '{"messages": [{"role": "user"}]}\n'])
    config = write_config(tmp_path / "drafter.yaml", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", config, "--target", str(target_dir), "--data", data])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{data}:4:" in err and "messages[0]" in err
    no_tok = save_tiny_qwen2(tmp_path / "bare", tokenizer=False)
    with pytest.raises(SystemExit):
        main(["--config", config, "--target", str(no_tok), "--data", write_jsonl(tmp_path / "ok.jsonl", RECORDS)])
    assert "no tokenizer with a chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", config, "--target", str(target_dir), "--data", str(tmp_path / "missing.jsonl")])
    assert "prompts_file" in capsys.readouterr().err


def test_lm_head_init_takes_the_untied_output_rows(tmp_path):
    """``init: lm_head`` on a target whose lm_head is not its embedding copies the lm_head's rows."""
    from rollout.eagle3 import Eagle3Config, Eagle3Head
    from trainers.drafter.train import init_from_target

    target, _ = load_target(TargetConfig(path=str(save_tiny_qwen2(tmp_path, tokenizer=False))))
    out = target.model.get_output_embeddings().weight
    assert not torch.equal(out, target.embed_tokens.weight)
    head = Eagle3Head(Eagle3Config.for_target(target, 50), target.embed_tokens)
    ids = torch.arange(0, VOCAB, 3)[:50]
    head.set_draft_vocab(ids)
    init_from_target(head, target, "lm_head")
    assert torch.equal(head.lm_head.weight, out[ids]) and torch.equal(head.norm.weight, target.model.model.norm.weight)
    with pytest.raises(ValueError, match="attention biases"):
        init_from_target(head, target, "layer")


@pytest.mark.parametrize("line, words", [
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not JSON"),
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"prompt": "a", "messages": []}', "exactly one of 'prompt'"),
    ('{"text": "a"}', "exactly one of 'prompt'"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "only assistant messages"),
    ('{"prompt": "a", "kind": 3}', "'kind' must be"),
])
def test_each_bad_record_is_named_by_file_and_line(tmp_path, line, words):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(PromptFileError, match=words) as err:
        read_prompt_file(path)
    assert str(err.value).startswith(f"{path}:3:")


def test_records_become_conversations_and_split_reproducibly(tmp_path):
    records = read_prompt_file(write_jsonl(tmp_path / "p.jsonl", RECORDS))
    assert records[0].messages == ({"role": "user", "content": "what is 2 + 3 ?"},) and records[0].kind == "file"
    assert [m["role"] for m in records[3].messages] == ["user", "assistant", "user"] and records[3].kind == "chat"
    split = [split_records(records, 0.34, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert split[0] == split[1] and len(split[0][1]) == 2 and len(split[0][0]) == 4
    assert sorted(r.line for part in split[2] for r in part) == list(range(1, 7))
    assert split_records(records, 0.0, torch.Generator())[1] == []
    with pytest.raises(PromptFileError, match="none to train on"):
        split_records(records[:1], 0.5, torch.Generator())
    with pytest.raises(PromptFileError, match="no records"):
        read_prompt_file(write_jsonl(tmp_path / "empty.jsonl", ["\n"]))
