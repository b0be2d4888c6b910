"""A TRL ``rollout_func`` that generates with our speculative backend.

TRL's ``GRPOTrainer`` calls ``rollout_func(prompts, trainer)`` once per generation batch
with the prompts already repeated ``num_generations`` times, and expects
``{"prompt_ids", "completion_ids", "logprobs", ...}``; extra keys reach the reward
functions. :class:`SpeculativeRollouts` is such a callable:

- **placement** ``"local"``: an ``hf`` backend in this process over the trainer's own
  model object (shared parameters: the rollouts always use the current weights, nothing is
  copied); ``"ray"``: our Ray actor pool (``rollout.ray.actor_pool``), which gets the
  trainer's weights pushed whenever TRL's optimizer step moved since the last push. With a
  peft LoRA policy the rollouts hold a plain model of the base architecture instead, loaded
  with the merged weights (``trainers.trl.peft_policy``) at each push, which are also what the
  actors and the vllm backend get (under the base model's parameter names).
- the chat template is applied here, at the backend boundary (conversational prompts);
  plain-text prompts are tokenized as TRL does;
- ``logprobs`` are the **behaviour log-probs** (log P(y) under the distribution the
  verifier induced), which TRL's importance-sampling correction divides by; the extra
  fields are ``tau`` (the call's mean acceptance length), ``relaxed_fraction`` (per
  completion: tokens emitted by a relaxed, lossy acceptance) and ``verifier`` (the rule).
- the sampling settings come from TRL's ``GRPOConfig`` (temperature,
  ``max_completion_length``), so TRL's recomputed log-probs and ours describe the same
  processed distribution; settings TRL's log-probs do not apply (top-p, top-k, min-p,
  repetition penalty) are refused.
- **the draft head follows the policy** by training with it (``drafter_training.every: n``,
  ``trainers.grpo.online_drafter``: after every n-th optimizer step the head is trained on the
  last training generation's sequences (not an evaluation's) under the updated policy, written
  to ``<output_dir>/drafter/`` and re-loaded by the backend or every actor; its state is saved
  with TRL's checkpoints and restored on resume) or by re-loading: with
  ``drafter_reload_every: n`` the head is re-read from its folder every n optimizer steps (a
  drafter trainer elsewhere may rewrite it). A head that stays fixed while the policy drifts
  keeps every output exact (the verifier corrects for any draft), but its acceptance tau falls
  as the policy moves away from the one it was trained on, so rollouts slow down; tau is
  logged every step (``speculative/tau``) to show it.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from rollout.backend import BACKENDS, RolloutBackend, WorkerSpec, build_backend, check_backend_options
from rollout.chat import chat_ids
from rollout.config import ConfigError
from rollout.config import check_int
from rollout.engine.backend import HFBackend
from rollout.models import TargetConfig
from rollout.outputs import RolloutBatch
from rollout.params import SamplingParams, SpecConfig, VerifierConfig, check_test, drift_warning
from trainers.grpo.online_drafter import OnlineDrafter, OnlineDrafterConfig
from trainers.trl.peft_policy import check_lora, is_peft_model, merged_state_dict, plain_copy

PLACEMENTS = ("local", "ray")
#: the speculation the plug-in uses unless told otherwise (``RolloutSettings.spec``), per backend.
#: hf: the engine's planner decides per round whether a chain pays (``max_batch: auto``). vllm takes
#: a fixed schedule only: chains in steps with at most 4 running requests (on the 2-core CPU a
#: chain of 3 ran at 1.75x vLLM's plain decoding at 1 request and 0.78x at 8; measured 2026-12-07, commit 4fb48c3)
DEFAULT_SPEC = {"hf": SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto"),
                "vllm": SpecConfig(mode="chain", num_draft_tokens=3, max_batch=4)}


@dataclass(frozen=True)
class RolloutSettings:
    """How the plug-in generates (one per trainer).

    spec / verifier: our speculation and verification settings. The default spec (null:
    ``DEFAULT_SPEC`` of the backend) drafts chains of 3 tokens only in the rounds where the
    engine's planner expects drafting to emit more tokens per second than a plain round
    (``max_batch: auto``): TRL's generation batches (num_generations completions per prompt)
    are large enough that drafting every round runs slower than plain decoding on a CPU.
    drafter: an EAGLE-3 head folder, "default" (the shipped head) or null (``spec.mode`` must
    be "off").
    drafter_reload_every: re-load the head from its folder every n optimizer steps (0 = never).
    drafter_training: train the head with the policy (``OnlineDrafterConfig``; ``every: 0``, the
    default, never does).
    placement: "local" (in this process, sharing the trainer's model) or "ray" (our actor pool;
    ``target`` is what each actor loads before the weights are pushed). seed: base seed of
    the rollouts (call i uses a seed derived from it and i). threads: torch threads of the
    local backend (null = the cores this process may use). backend: "hf" or "vllm" (vLLM
    with our verifier; it holds its own copy of the policy, so "local" pushes the trainer's
    weights to it after each optimizer step like "ray" does; ``target`` names what it loads
    first, null = the embedded model); backend_options: options of that backend (with
    "ray", the hf backend's ``weights: bfloat16`` rounds each actor's copy; "local" with "hf"
    shares the trainer's model and reads only ``drafter_weights: int8``, which rounds the head).
    """

    spec: SpecConfig | None = None
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    drafter: str | None = "default"
    drafter_reload_every: int = 0
    placement: str = "local"
    target: TargetConfig | None = None
    num_actors: int = 1
    threads_per_actor: int = 2
    seed: int = 0
    threads: int | None = None
    backend: str = "hf"
    backend_options: dict = field(default_factory=dict)
    drafter_training: OnlineDrafterConfig = field(default_factory=OnlineDrafterConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"unknown backend {self.backend!r}", allowed=sorted(BACKENDS))
        if self.spec is None:
            object.__setattr__(self, "spec", DEFAULT_SPEC[self.backend])
        if self.backend == "vllm" and self.spec.auto:
            raise ConfigError("spec.max_batch", "'auto' is not supported by the vllm backend (vLLM takes a fixed "
                              "batch-size schedule): give an integer, to draft only in steps with at most that many "
                              "running requests")
        if self.backend == "vllm" and self.spec.mode == "tree":
            raise ConfigError("spec.mode", "vLLM has no tree drafting; use 'chain' or 'off' with backend vllm")
        check_test(self.spec, self.verifier)
        if (message := drift_warning(self.spec, self.verifier)) is not None:
            warnings.warn(f"rollouts: {message}", stacklevel=2)
        if self.placement not in PLACEMENTS:
            raise ConfigError("placement", f"unknown placement {self.placement!r}", allowed=PLACEMENTS)
        if self.drafter is None and self.spec.mode != "off":
            raise ConfigError("spec.mode", "speculation needs a drafter (drafter is null)", allowed=["off"])
        for name in ("drafter_reload_every", "seed"):
            check_int(name, getattr(self, name), 0)
        if self.drafter_training.enabled and (self.drafter is None or self.spec.mode == "off"):
            raise ConfigError("drafter_training.every", "trains the head the rollouts draft with; there is none "
                              f"(drafter {self.drafter!r}, spec.mode {self.spec.mode!r}): set it to 0", allowed=[0])
        if self.drafter_training.enabled and self.drafter_reload_every:
            raise ConfigError("drafter_reload_every", "and drafter_training.every both replace the head; "
                              "keep one of them (set this to 0 to train the head here)", allowed=[0])
        for name in ("num_actors", "threads_per_actor"):
            check_int(name, getattr(self, name))
        if self.threads is not None:
            check_int("threads", self.threads)
        if self.placement == "ray" and self.target is None:
            raise ConfigError("target", "placement 'ray' needs the target config the actors load")
        if not isinstance(self.backend_options, dict):
            raise ConfigError("backend_options", f"must be a mapping, got {self.backend_options!r}")
        check_backend_options(self.backend, self.backend_options)  # here rather than in the backend's set-up
        if self.placement == "local" and self.backend == "hf" and set(self.backend_options) - {"drafter_weights"}:
            # the backend runs over the trainer's own model object: nothing to round or re-route
            raise ConfigError("backend_options", f"{sorted(self.backend_options)}: placement 'local' with the hf "
                              "backend shares the trainer's model and reads only drafter_weights (weights: "
                              "bfloat16 needs a copy of its own: placement 'ray')", allowed=["drafter_weights"])

    def drafter_path(self) -> str | None:
        if self.drafter == "default":
            from rollout.eagle3 import default_head_path

            return str(default_head_path())
        return self.drafter


def sampling_from_trl(args: Any, eos_token_id: int | None) -> SamplingParams:
    """Our SamplingParams from a TRL ``GRPOConfig``; refuses what TRL's log-probs do not apply."""
    unsupported = {"top_p": (args.top_p, 1.0), "top_k": (args.top_k, None), "min_p": (args.min_p, None),
                   "repetition_penalty": (args.repetition_penalty, 1.0)}
    for name, (value, neutral) in unsupported.items():
        if value is not None and value != neutral and not (name == "top_k" and value in (0, -1)):
            raise ConfigError(f"GRPOConfig.{name}", f"{value!r} is not supported with speculative rollouts: TRL "
                              "recomputes the policy log-probs with the temperature only, so the importance "
                              "ratios would compare different distributions", allowed=[neutral])
    t = args.temperature
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not t > 0:
        raise ConfigError("GRPOConfig.temperature", f"must be > 0 for policy-gradient rollouts, got {t!r}")
    if args.max_completion_length is None:
        raise ConfigError("GRPOConfig.max_completion_length", "must be set (speculative rollouts need a budget)")
    stop = (eos_token_id,) if eos_token_id is not None else ()
    try:  # SamplingParams checks the kinds and ranges (no int() truncation of 3.5)
        return SamplingParams(temperature=t, max_new_tokens=args.max_completion_length, stop_token_ids=stop)
    except ConfigError as err:  # named as the GRPOConfig argument it came from
        name = {"max_new_tokens": "max_completion_length"}.get(err.field, err.field)
        raise ConfigError(f"GRPOConfig.{name}", str(err).split(": ", 1)[1]) from None


def tokenize_prompts(tokenizer: Any, prompts: list, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of TRL prompts: chat messages get the chat template (with the generation prompt)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(list(tokenizer(text=prompt)["input_ids"]))
        else:
            out.append(chat_ids(tokenizer, prompt, **(chat_template_kwargs or {})))
    return out


class SpeculativeRollouts:
    """TRL's ``rollout_func``: our speculative backend under our verifier (see module docstring)."""

    def __init__(self, settings: RolloutSettings):
        self.settings = settings
        self.backend: RolloutBackend | None = None
        self.pool = None
        self.sampling: SamplingParams | None = None
        self.last_batch: RolloutBatch | None = None  # the last generation's (an evaluation's too)
        self.train_batch: RolloutBatch | None = None  # the last training generation's: the head trains on it
        self.last_seconds = 0.0
        self._calls = 0  # generations so far: the next one's seed (kept in checkpoints, ``state_dict``)
        self._pushed_step = -1
        self.process_index = 0  # this process's rank under torch.distributed (set by ``bind``)
        self._loaded_step = 0
        self.drafter: OnlineDrafter | None = None  # the head trained with the policy (drafter_training)
        self.drafter_metrics: dict[str, float] = {}  # the last round's, for the trainer's log
        self._trained_step = 0
        self.adapted = None  # the trainer's peft model, where it trains LoRA adapters
        self.plain = None  # then the rollouts' model of the base architecture with its merged weights

    # ------------------------------------------------------------------ set-up
    def bind(self, trainer: Any) -> None:
        """Build the backend for ``trainer`` (called by the trainer before training; idempotent)."""
        if self.sampling is not None:
            return
        tokenizer = _tokenizer(trainer)
        s = self.settings
        processes = trainer.accelerator.num_processes
        if s.drafter_training.enabled and processes > 1:
            raise ConfigError("drafter_training.every", f"trains the head in one process; with {processes} "
                              "processes each would train its own head and write it to the same folder: set it "
                              "to 0 (or train in one process)", allowed=[0])
        self.sampling = sampling_from_trl(trainer.args, tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.process_index = trainer.accelerator.process_index
        threads = s.threads if s.threads is not None else local_threads()
        drafter = s.drafter_path() if s.spec.mode != "off" else None
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if is_peft_model(policy):  # generate with the merged weights (peft_policy), pushed at every sync
            check_lora(policy)
            self.adapted, self.plain = policy, plain_copy(policy)
            policy = self.plain
        if s.placement == "local" and s.backend != "hf":  # its own weights: pushed in sync()
            self.backend = build_backend(WorkerSpec(
                target=s.target or TargetConfig(), drafter_path=drafter, sampling=self.sampling, spec=s.spec,
                verifier=s.verifier, threads=s.threads or 2, backend=s.backend, backend_options=s.backend_options))
        elif s.placement == "local":
            self.backend = HFBackend.from_model(policy, drafter_path=drafter, num_threads=threads, pad_id=pad,
                                                **s.backend_options)
        else:
            from rollout.ray.actor_pool import RolloutPool

            spec = WorkerSpec(target=s.target, drafter_path=drafter, sampling=self.sampling, spec=s.spec,
                              verifier=s.verifier, threads=s.threads_per_actor, backend=s.backend,
                              backend_options=s.backend_options)
            self.pool = RolloutPool(spec, s.num_actors, num_cpus_per_actor=s.threads_per_actor)
        if s.drafter_training.enabled:
            from pathlib import Path

            from rollout.models import TargetModel

            self.drafter = OnlineDrafter(s.drafter_training, Path(drafter), TargetModel(policy),
                                         Path(trainer.args.output_dir), s.seed)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    # ------------------------------------------------------------------ weights
    def sync(self, trainer: Any) -> None:
        """Bring the backend to the trainer's current policy (and head) before a generation."""
        step = int(trainer.state.global_step)
        every = self.settings.drafter_reload_every
        if every and step >= self._loaded_step + every and self.settings.spec.mode != "off":
            self._load_drafter(self.settings.drafter_path())
            self._loaded_step = step
        if step == self._pushed_step:
            return
        weights = self._policy_weights(trainer)
        if self.backend is not None and self.backend.name == "hf":
            self.backend.set_weights(None, step)  # shared parameters: only the version moves
        elif self.backend is not None:  # a backend with its own copy (vllm): push the weights
            self.backend.set_weights(weights, step)
        else:
            self.pool.set_weights(weights, step)
        self._pushed_step = step
        self.train_drafter(step)

    def train_drafter(self, step: int) -> None:
        """Where a round is due at optimizer step ``step`` (``drafter_training.every`` steps after
        the last, and a generation to train on): the head trained on the last training generation's
        sequences under the policy as it is now (``OnlineDrafter.train_on_batch``); every backend
        then drafts with it. Called before each generation, and before a checkpoint is written
        (so that it holds the head the next generation drafts with)."""
        if self.drafter is None or self.train_batch is None or step < self._trained_step + \
                self.settings.drafter_training.every:
            return
        if self.adapted is not None:  # the head learns the policy as it is now
            self.plain.load_state_dict(merged_state_dict(self.adapted))
        self.drafter_metrics = self.drafter.train_on_batch(step - 1, self.train_batch)
        self._trained_step = step
        self._load_drafter(str(self.drafter.export_path))

    def _policy_weights(self, trainer: Any) -> dict:
        """The policy's state dict under the base model's names: with LoRA the merged weights
        (``peft_policy.merged_state_dict``, also loaded into the rollouts' plain model)."""
        if self.adapted is None:
            return trainer.accelerator.unwrap_model(trainer.model).state_dict()
        weights = merged_state_dict(self.adapted)
        self.plain.load_state_dict(weights)
        return weights

    @property
    def trained_step(self) -> int:
        """The optimizer step of the head's last training round (0: none yet)."""
        return self._trained_step

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the rollouts (beside the trained head's state): the number of
        generations so far, from which the next one's seed follows."""
        return {"generations": self._calls}

    def load_state_dict(self, state: dict) -> None:
        """The rollouts' state from a checkpoint (``state_dict``): a resumed run continues the seeds."""
        self._calls = int(state["generations"])

    def restore_drafter(self, state: dict) -> None:
        """The trained head's state from a checkpoint (``OnlineDrafter.state_dict`` plus
        ``trained_step``); every backend then drafts with it."""
        self.drafter.load_state_dict(state)
        self._trained_step = int(state["trained_step"])
        self._load_drafter(str(self.drafter.export()))

    def _load_drafter(self, path: str) -> None:
        """Every backend (the local one, or each actor) drafts with the head in ``path``."""
        if self.backend is not None:
            self.backend.load_drafter(path)
        else:
            self.pool.load_drafter(path)

    # ------------------------------------------------------------------ generation
    def call_seed(self, call: int) -> int:
        """The seed of generation ``call`` (0, 1, ...) in this process: process 0 uses ``seed x
        1000003 + call``, process r that plus r x 2654435761, so that processes given the same
        prompts (TRL splits a prompt's group over them) sample their own completions. (The offset
        lies in the low 32 bits: torch's CPU generator keeps only those of a seed.)"""
        return self.settings.seed * 1_000_003 + call + self.process_index * 2_654_435_761

    def generate(self, prompt_ids: list[list[int]]) -> RolloutBatch:
        seed = self.call_seed(self._calls)
        self._calls += 1
        s = self.settings
        if self.backend is not None:
            return self.backend.generate(prompt_ids, sampling=self.sampling, spec=s.spec, verifier=s.verifier,
                                         seed=seed)
        ids = [f"{self._calls}/{i}" for i in range(len(prompt_ids))]
        batch, _ = self.pool.generate(ids, prompt_ids, seed=seed)
        return batch

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        self.bind(trainer)
        self.sync(trainer)
        prompt_ids = tokenize_prompts(_tokenizer(trainer), prompts, getattr(trainer, "chat_template_kwargs", None))
        t0 = time.perf_counter()
        batch = self.generate(prompt_ids)
        self.last_seconds = time.perf_counter() - t0
        self.last_batch = batch
        if trainer.model.training:  # TRL's own test; an evaluation's generation is not trained on
            self.train_batch = batch
        relaxed = (batch.relaxed & batch.completion_mask).sum(1) / batch.completion_mask.sum(1).clamp(min=1)
        return {
            "prompt_ids": batch.prompt_lists(),
            "completion_ids": batch.completion_lists(),
            "logprobs": batch.token_lists("behaviour_logprobs"),
            "tau": batch.tau,
            "relaxed_fraction": relaxed.tolist(),
            "verifier": self.settings.verifier.name,
        }


def local_threads() -> int | None:
    """Torch threads of a local backend left unset: None (the engine takes the cores this process
    may use) in a single process; under a launcher that starts several processes on this machine
    (``LOCAL_WORLD_SIZE``, set by ``accelerate launch`` and ``torchrun``) each takes its share, so
    that they do not oversubscribe the cores."""
    import os

    from rollout.engine.engine import available_cores

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, available_cores() // local) if local > 1 else None


def process_mean(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """Each value's mean over the processes (as TRL averages its own metrics before logging them);
    every process must call this with the same names. In one process: the values as they are."""
    if accelerator.num_processes == 1 or not values:
        return dict(values)
    import torch

    names = sorted(values)
    local = torch.tensor([[float(values[n]) for n in names]], dtype=torch.float64, device=accelerator.device)
    mean = accelerator.gather(local).mean(0).tolist()
    return dict(zip(names, mean))


def _tokenizer(trainer: Any) -> Any:
    proc = trainer.processing_class
    return getattr(proc, "tokenizer", proc)
