"""TRL's own ``GRPOTrainer`` (the installed ``trl``) on a tiny Llama, and the same micro-batch as ours.

`grpo_trainer` builds a ``GRPOTrainer`` (CPU, float64 weights, no mixed precision) from a ``GRPOConfig``
of the fields a TRL user writes; `trl_inputs` is what its ``_generate_and_score_completions`` hands to
``_compute_loss`` (prompt and completion ids and masks, one advantage per row, ``old_per_token_logps``,
``ref_per_token_logps``, ``num_items_in_batch``); `generate_and_score` runs that method itself, with the
generation replaced by fixed completions and a sampler's log-probabilities (TRL's vLLM path, whose
importance-sampling ratios it computes). `our_batch` is the same rows as a lit_losses RL micro-batch
(next-token ``labels`` on the completion tokens, per-token keys aligned with them).

TRL's fused head computes log-probabilities in float32 whatever the model's dtype, so its values agree
with a float64 computation to about 1e-6 (relative), not to float64's precision.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from datasets import Dataset
from transformers import LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from tests.objectives.peer_trainers import tiny_llama, tokenizer

PROMPT = 3  # prompt tokens of every row (no left padding: TRL's positions then equal ours)
LENGTHS = (6, 3, 5, 2)  # completion tokens of each row (right-padded to the longest)
MAX_COMPLETION = 8
REWARDS = (1.0, 0.0, 0.25, 2.0)  # one per row: two groups of two generations with unequal rewards


def llama(seed: int = 0, vocab_size: int | None = None) -> LlamaForCausalLM:
    """A 2-layer Llama of the shipped tokenizer's vocabulary, float64, seeded weights."""
    return tiny_llama(vocab_size or len(tokenizer()), seed=seed, max_position_embeddings=64)


def grpo_trainer(
    model: torch.nn.Module, output_dir: Path, reference: Path | None = None, **fields: Any
) -> GRPOTrainer:
    """TRL's ``GRPOTrainer`` on ``model`` with ``GRPOConfig(**fields)`` (CPU, no mixed precision, one
    process, no accumulation), `REWARDS` as its reward function. With
    ``beta > 0`` TRL loads its reference model from the policy's ``name_or_path``: ``reference``, a
    directory of a saved model."""
    if reference is not None:
        model.config._name_or_path = str(reference)
    args = GRPOConfig(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(LENGTHS),
        num_generations=2,
        max_completion_length=fields.pop("max_completion_length", MAX_COMPLETION),
        save_strategy="no",
        **fields,
    )
    data = Dataset.from_list([{"prompt": "Hello there"}] * len(LENGTHS))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: list(REWARDS[: len(completions)]),
        args=args,
        train_dataset=data,
        processing_class=tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by _compute_loss
    trainer.model._trl_fused = True  # the trainer added its fused head (with the entropy)
    trainer.model.train()
    return trainer


def logprobs(trainer: GRPOTrainer, model: torch.nn.Module, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """TRL's ``_get_per_token_logps_and_entropies`` of ``model`` on the rows' completions (no gradient);
    ``model`` gets TRL's fused head if it has none."""
    if not getattr(model, "_trl_fused", False):
        add_fused_lm_head(model)
        model._trl_fused = True
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1)
    mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1)
    with torch.no_grad():
        out = trainer._get_per_token_logps_and_entropies(model, ids, mask, rows["completion_ids"].shape[1])
    return out[0]


def rows(vocab_size: int, seed: int = 0, lengths: tuple[int, ...] = LENGTHS) -> dict[str, torch.Tensor]:
    """Prompt and completion ids and masks (TRL's layout: completions right-padded), one advantage per row."""
    g = torch.Generator().manual_seed(seed)
    B, C = len(lengths), max(lengths)
    completion_mask = (torch.arange(C)[None] < torch.tensor(lengths)[:, None]).long()
    completion_ids = torch.randint(5, vocab_size, (B, C), generator=g)
    return {
        "prompt_ids": torch.randint(5, vocab_size, (B, PROMPT), generator=g),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.where(completion_mask.bool(), completion_ids, 0),
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
    }


def trl_inputs(
    trainer: GRPOTrainer, reference: torch.nn.Module, seed: int = 0, lengths: tuple[int, ...] = LENGTHS
) -> dict[str, torch.Tensor]:
    """``_compute_loss``'s inputs as ``_generate_and_score_completions`` gives them: ``old_per_token_logps``
    the policy's moved by 0.35 · N(0, 1) (some ratios clipped, some not), ``ref_per_token_logps`` those of
    the trainer's reference model (or of ``reference``; TRL's own forward), ``num_items_in_batch`` the
    completion tokens."""
    out = rows(trainer.model.config.vocab_size, seed=seed, lengths=lengths)
    current = logprobs(trainer, trainer.model, out)
    g = torch.Generator().manual_seed(seed + 100)
    mask = out["completion_mask"].bool()
    noise = 0.35 * torch.randn(current.shape, generator=g, dtype=current.dtype)
    out["old_per_token_logps"] = torch.where(mask, current + noise, 0.0)
    out["ref_per_token_logps"] = logprobs(trainer, trainer.ref_model or reference, out)
    out["num_items_in_batch"] = out["completion_mask"].sum()
    return out


def on_labels(values: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-completion-token ``values`` ``[B, C]`` (or ``[B]``: one per row) at the positions of our
    next-token ``labels`` ``[B, P + C]`` (position ``P − 1 + j`` predicts completion token ``j``), 0
    elsewhere."""
    mask = inputs["completion_mask"].bool()
    B, C = mask.shape
    values = values[:, None].expand(B, C) if values.dim() == 1 else values
    out = torch.zeros(B, PROMPT + C, dtype=torch.float64)
    out[:, PROMPT - 1 : PROMPT - 1 + C] = torch.where(mask, values.to(torch.float64), 0.0)
    return out


def our_batch(inputs: Mapping[str, torch.Tensor], sampler: str = "old_per_token_logps") -> dict[str, Any]:
    """TRL's inputs as our RL micro-batch: ``input_ids`` prompt + completion, ``labels`` the completion
    tokens (next-token format), ``sampling_logprobs`` from ``inputs[sampler]``, ``old_logprobs`` (when the
    sampler is vLLM's, TRL's ``old_per_token_logps``), ``advantages``, ``ref_logprobs``."""
    mask = inputs["completion_mask"].bool()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    labels = torch.full_like(ids, -100)
    C = mask.shape[1]
    labels[:, PROMPT - 1 : PROMPT - 1 + C] = torch.where(mask, inputs["completion_ids"], -100)
    batch = {
        "input_ids": ids,
        "labels": labels,
        "sampling_logprobs": on_labels(inputs[sampler], inputs),
        "advantages": on_labels(inputs["advantages"], inputs),
    }
    if sampler != "old_per_token_logps":
        batch["old_logprobs"] = on_labels(inputs["old_per_token_logps"], inputs)
    if "ref_per_token_logps" in inputs:
        batch["ref_logprobs"] = on_labels(inputs["ref_per_token_logps"], inputs)
    return batch


def trl_loss_and_grads(trainer: GRPOTrainer, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, dict]:
    """TRL's ``_compute_loss`` on ``inputs`` (one micro-batch), its gradient for every parameter by name,
    and the metrics it logged (the last value of each)."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), {"grads": grads, "metrics": metrics}


def generate_and_score(
    trainer: GRPOTrainer, seed: int = 0, noise: float = 0.3, lengths: tuple[int, ...] = LENGTHS
) -> dict[str, torch.Tensor]:
    """TRL's own ``_generate_and_score_completions`` on fixed completions, as with vLLM: the generation
    returns the rows' completions and a sampler's log-probabilities (the policy's moved by ``noise`` ·
    N(0, 1)); TRL recomputes ``old_per_token_logps``, computes the importance-sampling ratio of its
    ``vllm_importance_sampling_mode``, the reference's log-probabilities, the rewards (`REWARDS`) and the
    group-normalized advantages, and logs its sampling metrics."""
    out = rows(trainer.model.config.vocab_size, seed=seed, lengths=lengths)
    current = logprobs(trainer, trainer.model, out)
    g = torch.Generator().manual_seed(seed + 200)
    sampling = current + noise * torch.randn(current.shape, generator=g, dtype=current.dtype)
    prompt_ids = [r.tolist() for r in out["prompt_ids"]]
    completion_ids = [r[:n].tolist() for r, n in zip(out["completion_ids"], lengths, strict=True)]
    sampling_list = [r[:n].tolist() for r, n in zip(sampling, lengths, strict=True)]
    texts = [f"completion {i}" for i in range(len(lengths))]

    def generate(prompts):
        return prompt_ids, completion_ids, None, texts, sampling_list, {}, None, None

    trainer._generate = generate
    trainer.use_vllm = True  # the vLLM path of the scoring, whose generation `generate` replaces
    trainer._metrics["train"].clear()
    inputs = [{"prompt": "Hello there"} for _ in lengths]
    scored = trainer._generate_and_score_completions(inputs)
    scored["metrics"] = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return scored
