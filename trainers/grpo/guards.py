"""Guards that keep a non-finite model from being broadcast or checkpointed.

A training step's update is checked at two points: the loss and the gradient norm before
``optimizer.step()`` (a NaN gradient would turn every weight it touches into NaN), and
the updated weights after it (an infinite learning rate or an overflow in the optimizer
state can break finite gradients). Either failure raises :class:`NonFiniteError` naming
the step and the quantity, before ``set_weights`` and before any checkpoint, so the last
checkpoint on disk stays the last good policy.
"""

from __future__ import annotations

import math

import torch

from rollout.config import _rebuild_error

class NonFiniteError(RuntimeError):
    """A loss, gradient norm or weight of a training step is NaN or infinite."""

    def __init__(self, step: int, quantity: str, detail: str):
        self.step, self.quantity = step, quantity
        if quantity.startswith("checkpoint"):
            super().__init__(f"step {step}: {quantity} is not finite ({detail})")
        elif quantity.startswith("drafter"):
            super().__init__(f"step {step}: {quantity} is not finite ({detail}); stopped before the head is shipped "
                             "to the actors or saved (the last checkpoint holds the last good head)")
        else:
            super().__init__(f"step {step}: {quantity} is not finite ({detail}); stopped before the weight "
                             "broadcast and before any checkpoint (the last checkpoint is the last good policy)")

    def __reduce__(self):  # crosses a pickle whole (the default would call __init__ with the message alone)
        return _rebuild_error, (type(self), self.args, self.__dict__)


def check_loss_and_grad(step: int, loss: float, grad_norm: float | torch.Tensor) -> None:
    """Before ``optimizer.step()``: the batch loss and the (pre-clipping) gradient norm."""
    if not math.isfinite(loss):
        raise NonFiniteError(step, "loss", f"loss = {loss}")
    g = float(grad_norm)
    if not math.isfinite(g):
        raise NonFiniteError(step, "gradient norm", f"grad_norm = {g}")


def check_weights(step: int, model: torch.nn.Module) -> None:
    """After ``optimizer.step()``: every parameter finite; names the first bad one."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            bad = int((~torch.isfinite(p)).sum())
            raise NonFiniteError(step, "updated weights", f"{name}: {bad} of {p.numel()} values NaN or inf")
