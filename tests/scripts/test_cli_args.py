"""Bad command-line values are refused by argparse, naming the flag, before any model loads
(``scripts/cli.py``'s types)."""

from __future__ import annotations

import re
import time

import pytest

from rollout.eagle3 import default_head_path


def _refused(main, argv, capsys) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert time.perf_counter() - t0 < 5.0, "refused before loading anything"
    return capsys.readouterr().err


@pytest.mark.parametrize("module", ["bench_rollout", "measure_acceptance", "research.measure_ceiling", "research.block_gain"])
def test_a_missing_head_folder_is_named(module, capsys, tmp_path):
    import importlib

    main = importlib.import_module(f"scripts.{module}").main
    err = _refused(main, ["--head", str(tmp_path / "nohead")], capsys)
    assert "argument --head: no EAGLE-3 head (config.json) at" in err, err


def test_a_head_folder_passes():
    from scripts.cli import head_folder

    assert head_folder(str(default_head_path())) == str(default_head_path())


@pytest.mark.parametrize("value, words", [("0", "must be >= 1"), ("1,-2", "must be >= 1"), ("1,x", "comma list")])
def test_bench_batch_sizes_are_checked(value, words, capsys):
    from scripts.bench_rollout import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--batch-sizes", value])
    assert "argument --batch-sizes: " in (err := capsys.readouterr().err) and words in err, err
    assert parse_args(["--batch-sizes", "1,8"]).batch_sizes == "1,8"


@pytest.mark.parametrize("argv, words", [(["--threads", "0"], "argument --threads: must be >= 1, got 0"),
                                         (["--threads", "-1"], "argument --threads: must be >= 1, got -1"),
                                         (["--stop-at", "0"], "argument --stop-at: must be >= 1, got 0")])
def test_train_drafter_flags_are_checked(argv, words, capsys):
    from scripts.train_drafter import main

    assert words in _refused(main, argv, capsys)


@pytest.mark.parametrize("module", ["bench_rollout", "research.bench_verifiers", "research.profile_step", "drift", "train_drafter"])
@pytest.mark.parametrize("value, words", [("0", "must be >= 1, got 0"), ("-2", "must be >= 1, got -2"),
                                          ("two", "must be an integer, got 'two'")])
def test_thread_counts_are_checked(module, value, words, capsys):
    import importlib

    main = importlib.import_module(f"scripts.{module}").main
    err = _refused(main, ["--threads", value], capsys)
    assert f"argument --threads: {words}" in err, err


def test_train_drafter_names_a_bad_config_field(tmp_path, capsys):
    from scripts.train_drafter import main

    path = tmp_path / "d.yaml"
    path.write_text("objectve: tv\n")
    err = _refused(main, ["--config", str(path)], capsys)
    assert err.startswith("error: config field 'objectve': unknown field") and "Traceback" not in err, err
    path.write_text("min_lr_ratio: 2\n")
    assert "config field 'min_lr_ratio'" in _refused(main, ["--config", str(path)], capsys)


@pytest.mark.parametrize("argv, words", [(["--verifiers", "marz"], "--verifiers 'marz': config field 'name'"),
                                         (["--modes", "chian"], "--modes: unknown mode 'chian'"),
                                         (["--tree", "3,x,8"], "--tree")])
def test_bench_rollout_refuses_bad_rows_before_loading(argv, words):
    from scripts.bench_rollout import main

    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match=re.escape(words)):
        main(argv)
    assert time.perf_counter() - t0 < 5.0, "refused before loading the models"
