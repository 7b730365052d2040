"""GRPO: a batch's rollouts rewarded by the Trainer, group-normalized advantages, the fixed terms of the update.

Nothing an Actor says about rewards is trusted: each completion is scored
here by the task's reward against the answer the Trainer kept.
A payload that does not parse, has the wrong group size, an over-long
completion or a token outside the vocabulary is dropped and counted.

The clipped-ratio update itself (over FSDP shards or one process) is
:func:`workers.trainer.fsdp.grpo_epochs`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from aurora_store.coordination.ledger import AcceptedResult
from workers.model import PASS_TOKENS, Packed, logprobs, pack_completions, rows_per_pass
from workers.task import Problem, RewardRunner
from workers.tokenizer import CharTokenizer, HFTokenizer
from workers.trainer.behaviour import BehaviourModel
from workers.trainer.fsdp import GrpoBatch

__all__ = ["Rollouts", "advantages", "behavior_logprobs", "grpo_batch", "read_rollouts"]


@dataclass(slots=True)
class Rollouts:
    """A batch's completions, flattened one row per sample, with the Trainer's rewards."""

    prompts: list[list[int]] = field(default_factory=list)
    """Prompt ids of each sample (``bos`` first)."""
    completions: list[list[int]] = field(default_factory=list)
    """Completion ids of each sample (an empty one becomes ``[eos]``)."""
    rewards: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    """Row of each group's first sample."""
    tokens: int = 0
    """Completion tokens over every accepted payload."""
    by_actor: dict[str, int] = field(default_factory=dict)
    """Prompts accepted per Actor."""
    bad: int = 0
    """Payloads dropped as malformed."""
    gen_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens each Actor generated (for its throughput estimate)."""
    gen_s: dict[str, float] = field(default_factory=dict)
    """Seconds each Actor reported generating them in."""


def read_rollouts(
    collected: Mapping[str, AcceptedResult],
    problems: Mapping[str, Problem],
    tokenizer: CharTokenizer | HFTokenizer,
    group: int,
    max_new_tokens: int,
    rewards: RewardRunner,
) -> Rollouts:
    """Parse, check and reward every collected payload, in prompt order.

    Rewards are the task's, computed by ``rewards`` (each call bounded in
    wall-clock time) from the completion's text as the tokenizer decodes it.
    """
    out = Rollouts()
    scored: list[tuple[str, Problem]] = []
    for pid, r in sorted(collected.items()):
        prob = problems.get(pid)  # the Trainer's batch checks prompt ids; a stray one is dropped, never a KeyError
        try:
            if prob is None:
                raise KeyError(pid)
            body = json.loads(r.payload)
            cs = [list(map(int, c)) for c in body["completions"]]
            if len(cs) != group or any(len(c) > max_new_tokens for c in cs):
                raise ValueError("wrong group size or completion length")
            if any(not 0 <= t < tokenizer.vocab_size for c in cs for t in c):
                raise ValueError("token id outside the vocabulary")
            took_s = max(1e-3, float(body.get("gen_s", 0.0)))
            if not took_s < float("inf"):
                raise ValueError("gen_s is not a finite number")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            out.bad += 1
            continue
        out.by_actor[r.actor] = out.by_actor.get(r.actor, 0) + 1
        n_tok = sum(len(c) for c in cs)
        out.tokens += n_tok
        out.gen_tokens[r.actor] = out.gen_tokens.get(r.actor, 0) + n_tok
        out.gen_s[r.actor] = out.gen_s.get(r.actor, 0.0) + took_s
        ids = tokenizer.render_prompt(prob.prompt_text)
        out.groups.append(len(out.prompts))
        for c in cs:
            out.prompts.append(ids)
            out.completions.append(c if c else [tokenizer.eos_id])
            scored.append((tokenizer.decode(c), prob))
    out.rewards = rewards.score(scored)
    return out


def advantages(rewards: list[float], group: int) -> torch.Tensor:
    """Group-normalized advantages: each reward minus its group's mean, over the group's std."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def behavior_logprobs(behavior: BehaviourModel, weights: Mapping[str, torch.Tensor], packed: Packed, micro_batch: int = 0) -> torch.Tensor:
    """Log-probs under the weights that generated the batch (``weights``: that version in bf16).

    With one-step asynchrony the batch was sampled from an older policy
    than the one being trained; the clipped ratio must be taken against
    that behaviour policy, not against the current weights. ``behavior``
    is the weightless bf16 module the version's tensors are lent to; the
    result is on the batch's device.
    """
    with torch.no_grad(), behavior.lent(weights) as module:
        out = logprobs(module, *_on(packed, behavior.device), reduction="none", micro_batch=micro_batch)
    return out.to(packed.input_ids.device)


def _on(packed: Packed, device: torch.device) -> Packed:
    return Packed(*(t.to(device) for t in packed))


def _module_device(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def grpo_batch(
    prompts: list[list[int]],
    comps: list[list[int]],
    rewards: list[float],
    group: int,
    pad_id: int,
    behavior: BehaviourModel,
    behavior_weights: Mapping[str, torch.Tensor],
    reference: torch.nn.Module | None,
    micro_batch: int = 0,
    tokens_per_pass: int = PASS_TOKENS,
) -> GrpoBatch | None:
    """Advantages and the fixed log-probabilities of a batch; None when no group has any signal.

    The batch is packed on the behaviour module's device (where the model
    runs); the reference runs wherever it is held. ``micro_batch``: rows per
    forward pass, here and in the update (0: as many as ``tokens_per_pass`` holds).
    """
    if not prompts:
        return None
    adv = advantages(rewards, group)
    keep = adv.abs() > 1e-6
    if not bool(keep.any()):
        return None  # every group uniform: no signal this step
    idx = torch.nonzero(keep).view(-1).tolist()
    packed = pack_completions([prompts[i] for i in idx], [comps[i] for i in idx], pad_id, behavior.device)
    micro_batch = rows_per_pass(micro_batch, int(packed.input_ids.shape[1]), tokens_per_pass)
    old = behavior_logprobs(behavior, behavior_weights, packed, micro_batch)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = logprobs(reference, *_on(packed, _module_device(reference)), reduction="none", micro_batch=micro_batch)
        ref = ref.to(packed.input_ids.device)
    return GrpoBatch(packed.input_ids, packed.attention_mask, packed.completion_mask, adv[idx].to(behavior.device), old, ref, micro_batch)
