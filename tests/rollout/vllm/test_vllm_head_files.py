"""Head and weight files as the vllm backend reads them, without vLLM: nothing is executed while
reading (safetensors, or ``torch.load(weights_only=True)`` for ``pytorch_model.bin``), a
truncated or corrupt file is reported naming it, a head drafting over the whole vocabulary
reaches vLLM without ``d2t`` (vLLM has no mapping then and refuses one), and a head whose aux
layers vLLM would capture in another order is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout.config import ConfigError
from rollout.vllm.head import check_head, prepare_head
from rollout.vllm.weights import expected_weight_names, read_head_weights

HEAD = Path(__file__).resolve().parents[3] / "rollout" / "heads" / "smollm2-135m-eagle3"
TARGET_CFG = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / "head"
    shutil.copytree(HEAD, out)
    return out


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


class _RunsCode:
    """Pickles as a call that creates ``marker`` (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("keep", [0.5, 0.0001])  # cut in the data / in the header
def test_a_truncated_safetensors_head_is_reported_naming_the_file(tmp_path, keep):
    head = _copy(tmp_path)
    _truncate(head / "model.safetensors", keep)
    for read in (lambda: check_head(head, TARGET_CFG), lambda: read_head_weights(head)):
        with pytest.raises(ValueError, match="does not read as a weights file") as err:
            read()
        assert str(head / "model.safetensors") in str(err.value)


def test_a_corrupt_head_config_is_reported_naming_the_file(tmp_path):
    head = _copy(tmp_path)
    (head / "config.json").write_text('{"vocab_size": 49152, ')
    with pytest.raises(ValueError, match="does not read as JSON") as err:
        check_head(head, TARGET_CFG)
    assert str(head / "config.json") in str(err.value)


def test_a_bin_head_loads_tensors_only_and_runs_no_code(tmp_path):
    head = _copy(tmp_path)
    tensors = load_file(str(head / "model.safetensors"))
    (head / "model.safetensors").unlink()
    torch.save(tensors, head / "pytorch_model.bin")
    assert check_head(head, TARGET_CFG)["vocab_size"] == 49152
    got = read_head_weights(head)
    assert set(got) == set(tensors) and torch.equal(got["fc.weight"], tensors["fc.weight"])

    marker = tmp_path / "code-ran"
    torch.save({**tensors, "extra": _RunsCode(marker)}, head / "pytorch_model.bin")
    for read in (lambda: check_head(head, TARGET_CFG), lambda: read_head_weights(head)):
        with pytest.raises(ValueError, match="not tensors") as err:
            read()
        assert str(head / "pytorch_model.bin") in str(err.value)
    assert not marker.exists()

    torch.save(tensors, head / "pytorch_model.bin")
    _truncate(head / "pytorch_model.bin")
    with pytest.raises(ValueError, match="truncated, corrupt") as err:
        read_head_weights(head)
    assert str(head / "pytorch_model.bin") in str(err.value)


def test_a_truncated_target_checkpoint_is_reported_naming_the_file(tiny_policy_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_policy_dir, target)
    cfg = json.loads((target / "config.json").read_text())
    assert "model.embed_tokens.weight" in expected_weight_names(target, cfg)
    _truncate(target / "model.safetensors")
    with pytest.raises(ValueError, match="does not read as a weights file") as err:
        expected_weight_names(target, cfg)
    assert str(target / "model.safetensors") in str(err.value)


def _full_vocab_head(tmp_path: Path, d2t_offset: int = 0) -> tuple[Path, dict]:
    """The tiny head's config and weights with a draft vocabulary as large as the target's."""
    from rollout.eagle3 import Eagle3Config, Eagle3Head, save_eagle3

    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, vocab_size=40, draft_vocab_size=40, target_hidden_size=64, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(cfg, torch.nn.Embedding(40, 64))
    with torch.no_grad():
        head.d2t[-1] = d2t_offset
    save_eagle3(head, tmp_path / "full")
    return tmp_path / "full", {"vocab_size": 40, "hidden_size": 64, "num_hidden_layers": 4}


def test_a_full_vocabulary_head_reaches_vllm_without_d2t(tmp_path):
    head, target = _full_vocab_head(tmp_path)
    cfg = check_head(head, target)
    assert {"d2t", "t2d"} <= set(load_file(str(head / "model.safetensors")))  # our writer stores them
    out = Path(prepare_head(head, cfg, tmp_path))
    assert out != head and not (out / "model.safetensors").is_symlink()
    written = load_file(str(out / "model.safetensors"))
    original = load_file(str(head / "model.safetensors"))
    assert set(written) == set(original) - {"d2t", "t2d"}
    assert all(torch.equal(written[k], original[k]) for k in written)
    assert json.loads((out / "config.json").read_text()) == cfg
    assert "d2t" not in read_head_weights(head)  # what load_drafter pushes


def test_a_full_vocabulary_head_with_a_permuting_d2t_is_refused(tmp_path):
    head, target = _full_vocab_head(tmp_path, d2t_offset=-1)
    cfg = check_head(head, target)
    with pytest.raises(ConfigError, match=r"drafter_path.*d2t is not the identity"):
        prepare_head(head, cfg, tmp_path)
    with pytest.raises(ConfigError, match="d2t is not the identity"):
        read_head_weights(head)


@pytest.mark.parametrize("ids", [[2, 2, 1], [15, 2, 27]])
def test_aux_layers_vllm_would_reorder_or_merge_are_refused(tmp_path, ids):
    head = _copy(tmp_path)
    cfg = json.loads((head / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not strictly increasing"):
        check_head(head, TARGET_CFG)
