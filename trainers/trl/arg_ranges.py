"""The range of every numeric ``GRPOConfig`` argument, checked when a TRL run's config loads.

TRL checks few numeric arguments itself (``num_generations >= 2``, ``warmup_steps >= 0``, the
batch divisibility); torch refuses others only once the model is loaded and the trainer builds
its optimizer (a negative ``learning_rate``, an ``adam_beta1`` of 1.5), and some are never
refused (a negative ``beta`` or ``epsilon`` trains something else without a word). ``RANGES``
gives each numeric field of ``GRPOConfig`` (TRL 1.16, with transformers' ``TrainingArguments``)
the range TRL, transformers or torch define or document for it; :func:`check_ranges` refuses a
value outside with a :class:`ConfigError` naming ``trl.<name>`` and the range, before any model
loads. A test checks that every numeric field has an entry, so a field a newer TRL adds is
noticed. Fields the script sets (``trainers.trl.config.OWNED``) and the importance-sampling
fields our correction section sets are refused before this check and have no entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.config import ConfigError


@dataclass(frozen=True)
class Range:
    """A closed or open interval; ``high`` None: unbounded above. ``why``: said with a refusal."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""


POSITIVE_INT = Range(1)
NON_NEGATIVE = Range(0)
POSITIVE = Range(0, low_open=True)
UNIT = Range(0, 1)  # [0, 1]
PORT = Range(1, 65535)

RANGES: dict[str, Range] = {
    # optimizer and schedule (torch.optim.AdamW's own checks, run only once training starts)
    "learning_rate": Range(0, why="torch's AdamW refuses a negative one"),
    "weight_decay": Range(0, why="torch's AdamW refuses a negative one"),
    "adam_beta1": Range(0, 1, high_open=True, why="torch's AdamW takes [0, 1)"),
    "adam_beta2": Range(0, 1, high_open=True, why="torch's AdamW takes [0, 1)"),
    "adam_epsilon": Range(0, why="torch's AdamW refuses a negative one"),
    "max_grad_norm": Range(0, why="0 turns clipping off; a negative norm turns it off silently"),
    "num_train_epochs": POSITIVE,
    "warmup_steps": Range(0, why="steps, or below 1 a fraction of the run"),
    "gradient_accumulation_steps": POSITIVE_INT,
    "label_smoothing_factor": UNIT,
    "neftune_noise_alpha": NON_NEGATIVE,
    "router_aux_loss_coef": NON_NEGATIVE,
    # logging, evaluation, saving, data loading, processes
    "logging_steps": Range(0, low_open=True, why="steps, or below 1 a fraction of the run"),
    "eval_steps": Range(0, low_open=True, why="steps, or below 1 a fraction of the run"),
    "save_steps": Range(0, low_open=True, why="steps, or below 1 a fraction of the run"),
    "eval_delay": NON_NEGATIVE,
    "per_device_eval_batch_size": POSITIVE_INT,
    "eval_accumulation_steps": POSITIVE_INT,
    "torch_empty_cache_steps": POSITIVE_INT,
    "save_total_limit": Range(1, why="transformers keeps every checkpoint for 0 or less: say null for that"),
    "data_seed": NON_NEGATIVE,
    "dataloader_num_workers": NON_NEGATIVE,
    "dataloader_prefetch_factor": POSITIVE_INT,
    "ddp_bucket_cap_mb": POSITIVE_INT,
    "ddp_timeout": POSITIVE_INT,
    "local_rank": Range(-1, why="-1: not launched by torch.distributed"),
    "num_completions_to_print": NON_NEGATIVE,
    # generation
    "num_generations": Range(2, why="GRPO's advantages compare the completions of a prompt"),
    "num_generations_eval": POSITIVE_INT,
    "max_completion_length": POSITIVE_INT,
    "pad_to_multiple_of": POSITIVE_INT,
    "generation_batch_size": POSITIVE_INT,
    "steps_per_generation": POSITIVE_INT,
    "temperature": Range(0, low_open=True, why="a sampling temperature"),
    "top_p": Range(0, 1, low_open=True, why="TRL's documented range"),
    "top_k": Range(0, why="0 turns top-k filtering off"),
    "min_p": Range(0, 1, why="TRL's documented range"),
    "repetition_penalty": POSITIVE,
    "max_tool_calling_iterations": POSITIVE_INT,
    "vllm_server_port": PORT,
    "vllm_group_port": PORT,
    "vllm_server_timeout": POSITIVE,
    "vllm_gpu_memory_utilization": Range(0, 1, low_open=True, why="a fraction of the GPU's memory"),
    "vllm_max_model_length": POSITIVE_INT,
    "vllm_tensor_parallel_size": POSITIVE_INT,
    # the loss
    "beta": Range(0, why="a KL coefficient"),
    "num_iterations": POSITIVE_INT,
    "epsilon": Range(0, why="the clipping range 1 - epsilon"),
    "epsilon_high": Range(0, why="the clipping range 1 + epsilon_high"),
    "delta": Range(1, low_open=True, why="an upper bound of the ratio, whose on-policy value is 1; TRL "
                   "recommends more than 1 + epsilon"),
    "sapo_temperature_neg": POSITIVE,
    "sapo_temperature_pos": POSITIVE,
    "vespo_k_pos": NON_NEGATIVE,
    "vespo_k_neg": NON_NEGATIVE,
    "vespo_lambda_pos": POSITIVE,
    "vespo_lambda_neg": POSITIVE,
    "ref_model_mixup_alpha": UNIT,
    "ref_model_sync_steps": POSITIVE_INT,
    "top_entropy_quantile": Range(0, 1, why="TRL's documented range"),
    "entropy_coef": Range(0, why="an entropy bonus's coefficient"),
    "entropy_coef_min": NON_NEGATIVE,
    "entropy_coef_max": NON_NEGATIVE,
    "entropy_coef_delta": NON_NEGATIVE,
    "entropy_target": Range(0, why="an entropy in nats"),
    "off_policy_mask_threshold": Range(0, low_open=True, why="TRL expects a positive value"),
}


def check_ranges(trl: dict[str, Any], fields: dict[str, Any]) -> None:
    """Refuse a numeric trl argument outside its :data:`RANGES` entry; ``fields``: GRPOConfig's
    dataclass fields by name (their types and defaults). The kind, int or float, is checked
    before (``rollout.config.check_leaf``); null and a string (``pad_to_multiple_of: auto``) pass."""
    for name in sorted(trl):
        value, r = trl[name], RANGES.get(name)
        if r is None or value is None or isinstance(value, (str, bool)):
            continue
        low_ok = value > r.low if r.low_open else value >= r.low
        high_ok = r.high is None or (value < r.high if r.high_open else value <= r.high)
        if low_ok and high_ok and value == value:
            continue
        kind = "an integer" if _is_int_field(fields[name].type) else "a number"
        if r.high is None:
            where = f"{'>' if r.low_open else '>='} {r.low:g}"
        else:
            where = f"in {'(' if r.low_open else '['}{r.low:g}, {r.high:g}{')' if r.high_open else ']'}"
        raise ConfigError(f"trl.{name}", f"must be {kind} {where}, got {value!r}" + (f" ({r.why})" if r.why else ""))
    low, high = (trl.get(k, fields[k].default) for k in ("entropy_coef_min", "entropy_coef_max"))
    if low > high:
        raise ConfigError("trl.entropy_coef_min", f"must not exceed trl.entropy_coef_max ({high!r}), got {low!r}")


def numeric_fields(fields: dict[str, Any]) -> list[str]:
    """The names of GRPOConfig's int and float fields (``int``, ``float``, optionally ``| None`` or
    ``| str``)."""
    return [name for name, f in fields.items() if _numeric_args(f.type)]


def _numeric_args(tp: Any) -> set[type]:
    import types
    import typing

    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return {a for a in args if a in (int, float)}


def _is_int_field(tp: Any) -> bool:
    return _numeric_args(tp) == {int}
