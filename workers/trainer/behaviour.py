"""The bf16 module behaviour log-probabilities and evaluations run on, without weights of its own.

The behaviour policy is exactly the bf16 version an Actor sampled from, and
the Trainer already holds that version (:mod:`workers.trainer.held`): a
second full copy of the model for it (let alone an fp32 one) would cost
2-4 bytes per parameter for nothing. :class:`BehaviourModel` is the model's
structure with its parameters on the meta device; :meth:`BehaviourModel.lent`
points them at a version's tensors for the length of one computation (no copy
when the version is held where the module runs, one per tensor otherwise) and
back to nothing afterwards. The module casts its buffers to bf16 as an
Actor's engine does, so what it computes is what the Actor's model computes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping

import torch

from aurora_store.errors import ModelMismatchError

__all__ = ["VERSIONS_BYTES_PER_PARAM", "BehaviourModel", "versions_device"]


class BehaviourModel:
    """A weightless bf16 copy of a model's structure on ``device``; see the module's docstring."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str) -> None:
        self.device = torch.device(device)
        # The parameters are replaced by meta tensors before the copy: nothing of the model's size is allocated.
        memo: dict[int, object] = {
            id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16, device="meta"), requires_grad=False)
            for p in model.parameters()
        }
        module = copy.deepcopy(model, memo)
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is not None:
                    sub._buffers[name] = buf.to(device=self.device, dtype=torch.bfloat16 if buf.is_floating_point() else buf.dtype)
        self.module = module.eval().requires_grad_(False)
        self.params: list[tuple[str, torch.nn.Parameter]] = list(module.named_parameters())
        """Each parameter once (a tied head is the embedding's parameter)."""
        self._owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for sub in module.modules():
            for key, p in sub._parameters.items():
                if p is not None:
                    self._owners.setdefault(id(p), []).append((sub, key))

    @contextlib.contextmanager
    def lent(self, weights: Mapping[str, torch.Tensor]) -> Iterator[torch.nn.Module]:
        """The module with ``weights`` (Hugging Face names, bf16) as its parameters, while the block runs.

        The tensors are used as they are where they already are bf16 on the
        module's device: nothing may write them (the module runs without gradients).
        """
        try:
            for name, p in self.params:
                t = weights[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ModelMismatchError(f"{name}: the version holds {list(t.shape)}, the model {list(p.shape)}")
                self._set(p, torch.nn.Parameter(t.detach().to(device=self.device, dtype=torch.bfloat16), requires_grad=False))
            yield self.module
        finally:
            for _, p in self.params:
                self._set(p, p)

    def _set(self, meta: torch.nn.Parameter, value: torch.nn.Parameter) -> None:
        """Every place the meta parameter ``meta`` sits in the module (a tied one sits in two) now holds ``value``."""
        for sub, key in self._owners[id(meta)]:
            sub._parameters[key] = value

    @property
    def nbytes(self) -> int:
        """Bytes the module holds between uses (its buffers; the parameters are meta)."""
        return sum(b.numel() * b.element_size() for b in self.module.buffers() if b.device.type != "meta")


VERSIONS_BYTES_PER_PARAM = 20
"""Device memory per parameter below which ``versions_on=auto`` keeps the bf16 versions on the host
(one process): the fp32 master, its gradient and AdamW's two moments take 16, a bf16 version 2,
and 2 more for activations and buffers. With N ranks the 16 are split N ways."""


def versions_device(choice: str, device: torch.device, params: int, device_bytes: int | None = None, world: int = 1) -> torch.device:
    """Where the Trainer keeps its bf16 versions: ``choice`` (``device``, ``host`` or ``auto``, see
    :attr:`~workers.trainer.config.TrainerConfig.versions_on`) for a model of ``params`` parameters
    trained on ``device`` (over ``world`` ranks), whose memory is ``device_bytes`` (read from CUDA when None)."""
    if choice == "host":
        return torch.device("cpu")
    if choice == "device" or device.type != "cuda":
        return device
    if device_bytes is None:
        device_bytes = int(torch.cuda.get_device_properties(device).total_memory)
    need = (VERSIONS_BYTES_PER_PARAM - 16 + 16 / max(1, world)) * params
    return torch.device("cpu") if device_bytes < need else device
