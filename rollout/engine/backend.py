"""``HFBackend``: our speculative engine (:class:`rollout.engine.engine.Engine`) behind the rollout
interface (:class:`rollout.backend.RolloutBackend`), registered as ``hf``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rollout.backend import WorkerSpec
from rollout.config import ConfigError
from rollout.engine.engine import Engine
from rollout.kernels import native_linear
from rollout.kernels.quantize import check_drafter_weights, quantize_int8_
from rollout.models import WEIGHT_ROUNDINGS, TargetModel, load_target, round_weights_
from rollout.options import EngineOptions
from rollout.outputs import RolloutBatch
from rollout.params import SamplingParams, SpecConfig, VerifierConfig


def check_options(options: Mapping) -> None:
    """Refuse unknown or bad ``backend_options`` (ConfigError naming the option and the allowed
    values): called by the training config before anything starts, and by the backend."""
    HFBackend.check_options(options)


class HFBackend:
    """Our speculative engine (``rollout.engine.engine.Engine``) behind the rollout interface."""

    name = "hf"

    # backend_options it reads: ``linear`` (``Engine``'s keyword of that name); ``weights``:
    # ``exact`` (the policy's weights as sent), ``bfloat16`` (each weight matrix rounded
    # stochastically to bf16 values at load and at every weight sync, seeded by the version,
    # ``rollout.models.round_weights_``: half the bytes per step, fp32 arithmetic; the behaviour
    # log-probs are the rounded model's) or ``bfloat16_nearest`` (nearest rounding: lags the policy);
    # ``drafter_weights``: ``stored`` (the head as its folder holds it) or ``int8`` (each of its
    # linear layers rounded to integers times a scale per row at load, ``rollout.kernels.quantize``: a
    # quarter of fp32's bytes per draft step; the rollouts' law and log-probs stay exact, since
    # drafts are verified against the rounded head's own draft law)
    OPTIONS = ("linear", "weights", "drafter_weights")

    # options: the engine's EngineOptions (None: the defaults), for a caller that builds the backend
    # itself (an A/B measurement); not a backend option (the YAML's engines run the defaults)
    def __init__(self, target: TargetModel, head=None, *, num_threads: int | None = None, pad_id: int = 0,
                 version: int = 0, linear: str = "auto", weights: str = "exact", drafter_weights: str = "stored",
                 options: EngineOptions | None = None):
        self.target, self.pad_id, self._version = target, pad_id, int(version)
        self.weights, self.drafter_weights = weights, check_drafter_weights(drafter_weights)
        if head is not None:
            self._prepare_head(head)
        round_weights_(target.model, weights, seed=self._version)
        self.engine = Engine(target, head, num_threads=num_threads, linear=linear,
                             options=options if options is not None else EngineOptions())

    @classmethod
    def check_options(cls, options: Mapping) -> None:
        """Refuse unknown or bad ``backend_options`` (ConfigError naming the option and the
        allowed values): called by the training config before anything starts, and here."""
        unknown = set(options) - set(cls.OPTIONS)
        if unknown:
            raise ConfigError("backend_options", f"unknown hf option(s) {sorted(unknown)}", allowed=cls.OPTIONS)
        if options.get("linear", "auto") not in native_linear.MODES:
            raise ConfigError("backend_options.linear", f"unknown linear mode {options['linear']!r}",
                              allowed=native_linear.MODES)
        if options.get("weights", "exact") not in WEIGHT_ROUNDINGS:
            raise ConfigError("backend_options.weights", f"unknown weight rounding {options['weights']!r}",
                              allowed=WEIGHT_ROUNDINGS)
        check_drafter_weights(options.get("drafter_weights", "stored"))

    @classmethod
    def from_spec(cls, spec: WorkerSpec) -> HFBackend:
        options = dict(spec.backend_options)
        cls.check_options(options)  # before the target loads
        target, tokenizer = load_target(spec.target)
        target.to(spec.device)
        pad_id = getattr(tokenizer, "pad_token_id", None)
        backend = cls(target, None, num_threads=spec.threads, pad_id=pad_id if pad_id is not None else 0,
                      **options)
        if spec.drafter_path is not None and spec.spec.mode != "off":
            backend.load_drafter(spec.drafter_path)
        return backend

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, drafter_path: str | None = None,
                   aux_layer_ids: tuple[int, int, int] | None = None, num_threads: int | None = None,
                   pad_id: int = 0, drafter_weights: str = "stored") -> HFBackend:
        """A backend over a Hugging Face causal LM that the caller keeps training (shared weights)."""
        backend = cls(TargetModel(model, aux_layer_ids), None, num_threads=num_threads, pad_id=pad_id,
                      drafter_weights=drafter_weights)
        if drafter_path is not None:
            backend.load_drafter(drafter_path)
        return backend

    @property
    def version(self) -> int:
        return self._version

    @property
    def head(self):
        return self.engine.head

    def load_drafter(self, path: str) -> None:
        """Load (or re-load) the EAGLE-3 head from a folder (rounded to int8 weights where
        ``drafter_weights`` says so); a head for another target is refused."""
        from rollout.eagle3 import load_eagle3

        head = load_eagle3(path, self.target).to(self.target.device)
        if head.cfg.vocab_size != self.target.vocab_size:
            raise ValueError(f"drafter {path}: vocab_size {head.cfg.vocab_size} != target vocab_size "
                             f"{self.target.vocab_size}")
        self._prepare_head(head)
        self.engine.head = head
        self.engine.forget_plans()  # acceptance was learned with the old head

    def _prepare_head(self, head) -> None:
        """The head as ``drafter_weights`` says: rounded to int8 weights in place, or as loaded."""
        if self.drafter_weights == "int8":
            quantize_int8_(head)

    def set_weights(self, state_dict: Mapping[str, torch.Tensor] | None, version: int) -> int:
        """Load new policy weights in place, rounded as ``weights`` says (None: the parameters are
        shared, only the version moves)."""
        if state_dict is not None:
            self.target.model.load_state_dict(state_dict)
            round_weights_(self.target.model, self.weights, seed=int(version))  # a replacement actor rounds alike
        self._version = int(version)
        return self._version

    @torch.inference_mode()
    def next_token_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """Raw target logits [N, V] after each prompt (a check that the weights are the policy's)."""
        model, dev = self.target.model, self.target.device
        rows = [model(input_ids=torch.tensor([p], device=dev), use_cache=False).logits[0, -1] for p in prompts]
        return torch.stack(rows).float().cpu()

    def generate(self, prompts: list[list[int]], *, sampling: SamplingParams, spec: SpecConfig,
                 verifier: VerifierConfig, seed: int) -> RolloutBatch:
        model = self.target.model
        training = model.training  # a trainer's model: generate in eval mode (no dropout, no
        model.eval()               # gradient-checkpointing wrappers), then give it back as it was
        try:
            result = self.engine.generate(prompts, sampling=sampling, spec=spec, verifier=verifier, seed=seed)
        finally:
            model.train(training)
        return result.to_batch(policy_version=self._version, pad_id=self.pad_id)
