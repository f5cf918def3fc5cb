"""The package's own offline RL example: completions sampled from a seeded `TinyLM`, with their own
log-probabilities and a rule-based reward, written as JSONL records (`lit_losses.data.rl_records`).

    python -m lit_losses.data.rollouts --out data/rollouts.jsonl --num-prompts 96 --group-size 4 --seed 0
    python -m lit_losses.data.rollouts --out data/rollouts_fp8.jsonl --num-prompts 48 \
        --engine-dtype float8_e4m3fn

- **Vocabulary** (characters, `VOCAB_SIZE` = 32): ``0`` end of completion (also the padding input of
  `RLDataModule`, ``pad_id=0``), ``1..26`` ``a..z``, then space, ``.``, ``,``, ``?``, ``!``.
- **Prompts**: a random word of 3 to 6 letters followed by ``?`` (drawn with ``seed``).
- **Policy**: ``TinyLM(vocab_size=32, d_model=64, n_layers=2, n_heads=4)`` initialized under
  ``torch.manual_seed(seed)`` and run in float64, so that neither the sampled tokens nor their
  log-probabilities depend on the machine's float32 reductions.
- **Completions**: ``group_size`` per prompt, sampled at temperature 1 until the end token or
  ``max_new_tokens``; ``logprobs`` holds ``log π(token | prefix)`` of each sampled token (null for the
  prompt), ``ref_logprobs`` the same initial model's (the reference policy of ``kl_reference``).
- **An inference engine** (``engine_dtype``, default none): the completions are sampled from an engine
  that serves the policy with weights rounded to ``engine_dtype`` (e.g. ``float8_e4m3fn``; computed in
  float64), whose log-probabilities are ``logprobs`` (π_rollout); the trainer's own, the float64 policy's,
  are ``old_logprobs`` (π_old) and ``ref_logprobs``: the rollout–training mismatch of
  `lit_losses.objectives.correction`, with a known cause.
- **Reward**: the fraction of the completion's characters that occur in the prompt's word (0 for an empty
  completion). **Advantage** (GRPO): ``(r − mean of the group) / (std of the group + 1e-6)`` with the
  unbiased std, broadcast over the completion's tokens.

Each record also carries ``reward`` and ``text`` (the decoded sequence), which the reader ignores.
`SamplingPolicyInit` (a callback) starts a training run from the sampling policy's weights, so that the
ratio ``p_θ / q`` is 1 at the first step, as in on-policy RL. This module imports the model package, so
nothing in `lit_losses.data` imports it.
"""

from __future__ import annotations

import argparse
import math
import string
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch

from lit_losses.data.rl_records import write_jsonl
from lit_losses.errors import ConfigError
from lit_losses.models.tiny_lm import TinyLM

END_ID = 0
ALPHABET = string.ascii_lowercase + " .,?!"
VOCAB_SIZE = 1 + len(ALPHABET)
POLICY_SHAPE = {"vocab_size": VOCAB_SIZE, "d_model": 64, "n_layers": 2, "n_heads": 4}
"""The sampling policy's `TinyLM` arguments (``configs/rl_offline.yaml`` trains a model of this shape)."""
DIGITS = 8
"""Decimals kept in the file's log-probabilities and advantages."""


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (characters of `ALPHABET`).

    Example:
        >>> encode("ab?"), decode(encode("ab?") + [END_ID])
        ([1, 2, 30], 'ab?<end>')
    """
    return [1 + ALPHABET.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    """The text of token ids (``<end>`` for the end token)."""
    return "".join("<end>" if i == END_ID else ALPHABET[i - 1] for i in ids)


def sampling_policy(seed: int = 0) -> TinyLM:
    """The float64 `TinyLM` of `POLICY_SHAPE` initialized under ``torch.manual_seed(seed)`` (the global
    random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(**POLICY_SHAPE, head_backend="naive")
    return model.double().eval()


def inference_engine(seed: int = 0, dtype: str = "float8_e4m3fn") -> TinyLM:
    """`sampling_policy` ``(seed)`` as an engine that stores its weights in ``dtype`` serves it: every
    weight rounded to ``dtype`` (a torch dtype's name) and computed in float64.

    Example:
        >>> engine = inference_engine(0, "bfloat16")
        >>> weight, trainer = engine.body.embed.weight, sampling_policy(0).body.embed.weight
        >>> torch.equal(weight, weight.to(torch.bfloat16).double()), torch.equal(weight, trainer)
        (True, False)
    """
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ConfigError(f"engine dtype {dtype!r} is not a floating-point torch dtype (e.g. float8_e4m3fn)")
    model = sampling_policy(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch_dtype).double())
    return model


@torch.no_grad()
def trainer_logprobs(model: TinyLM, tokens: Sequence[int], start: int) -> list[float]:
    """``log π(tokens[i] | tokens[:i])`` under ``model`` for ``i ≥ start`` (one forward of the sequence)."""
    ids = torch.tensor([list(tokens)])
    logprobs = torch.log_softmax(model.forward_logits({"input_ids": ids})[0, :-1], dim=-1)
    targets = ids[0, 1:, None]
    return logprobs.gather(1, targets)[start - 1 :, 0].tolist()


def reward(prompt: Sequence[int], completion: Sequence[int]) -> float:
    """Fraction of the completion's characters (the end token excluded) that occur in the prompt's word.

    Example:
        >>> reward(encode("cat?"), encode("tac.") + [END_ID])
        0.75
    """
    chars = [t for t in completion if t != END_ID]
    word = set(prompt[:-1])  # without the "?"
    return sum(t in word for t in chars) / len(chars) if chars else 0.0


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO's advantages of one group: ``(r − mean) / (std + eps)``, unbiased std (0 for equal rewards).

    Example:
        >>> [round(a, 4) for a in group_advantages([1.0, 0.0, 0.0, 1.0])]
        [0.866, -0.866, -0.866, 0.866]
    """
    values = torch.tensor(rewards, dtype=torch.float64)
    centered = values - values.mean()
    std = values.std() if len(values) > 1 else torch.tensor(0.0, dtype=torch.float64)
    return (centered / (std + eps)).tolist()


@torch.no_grad()
def sample_group(
    model: TinyLM, prompt: list[int], group_size: int, max_new_tokens: int, generator: torch.Generator
) -> list[tuple[list[int], list[float]]]:
    """``group_size`` completions of ``prompt`` (until the end token) and each token's log-probability."""
    ids = torch.tensor([prompt] * group_size)
    done = torch.zeros(group_size, dtype=torch.bool)
    completions: list[tuple[list[int], list[float]]] = [([], []) for _ in range(group_size)]
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(model.forward_logits({"input_ids": ids})[:, -1], dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
        for g in torch.nonzero(~done).flatten().tolist():
            completions[g][0].append(int(tokens[g]))
            completions[g][1].append(float(logprobs[g, tokens[g]]))
        done |= tokens == END_ID
        if bool(done.all()):
            break
        ids = torch.cat([ids, tokens[:, None]], dim=1)
    return completions


def generate_rollouts(
    num_prompts: int = 96,
    group_size: int = 4,
    max_new_tokens: int = 16,
    seed: int = 0,
    engine_dtype: str | None = None,
) -> list[dict[str, Any]]:
    """The example's records (flat form), ``group_size`` consecutive records per prompt; with
    ``engine_dtype`` sampled by `inference_engine` and with the trainer's ``old_logprobs``.

    Example:
        >>> records = generate_rollouts(num_prompts=2, group_size=2, max_new_tokens=4)
        >>> len(records), sorted(records[0])
        (4, ['advantage', 'logprobs', 'ref_logprobs', 'reward', 'text', 'tokens'])
        >>> sorted(generate_rollouts(num_prompts=1, group_size=2, engine_dtype="bfloat16")[0])
        ['advantage', 'logprobs', 'old_logprobs', 'ref_logprobs', 'reward', 'text', 'tokens']
    """
    trainer = sampling_policy(seed)
    model = trainer if engine_dtype is None else inference_engine(seed, dtype=engine_dtype)
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(num_prompts):
        length = int(torch.randint(3, 7, (1,), generator=generator))
        word = torch.randint(0, 26, (length,), generator=generator).tolist()
        prompt = encode("".join(string.ascii_lowercase[i] for i in word) + "?")
        group = sample_group(
            model, prompt=prompt, group_size=group_size, max_new_tokens=max_new_tokens, generator=generator
        )
        rewards = [reward(prompt, completion) for completion, _ in group]
        for (completion, logprobs), r, adv in zip(group, rewards, group_advantages(rewards), strict=True):
            lps = [None] * len(prompt) + [round(lp, DIGITS) for lp in logprobs]
            tokens, advantage = prompt + completion, round(adv, DIGITS)
            record = {"tokens": tokens, "logprobs": lps, "ref_logprobs": list(lps)}
            if engine_dtype is not None:  # the trainer's log-probabilities: π_old and the reference
                old = trainer_logprobs(trainer, tokens, start=len(prompt))
                record["ref_logprobs"] = [None] * len(prompt) + [round(lp, DIGITS) for lp in old]
                record["old_logprobs"] = list(record["ref_logprobs"])
            records.append({**record, "advantage": advantage, "reward": r, "text": decode(tokens)})
    return records


class SamplingPolicyInit(L.Callback):
    """Start training from the example's sampling policy: `sampling_policy` ``(seed)``'s weights (cast to
    the model's dtype) are loaded into the model when ``fit`` is set up, before a ``--ckpt_path``
    checkpoint is restored (which then wins, so a resumed run is unchanged).

    The model must be a `TinyLM` of `POLICY_SHAPE` with tied embeddings (its `RegularizedLM` options,
    the base loss and regularizers among them, are free). From YAML: ``trainer.callbacks: [{class_path:
    lit_losses.data.rollouts.SamplingPolicyInit, init_args: {seed: 0}}]``.

    Args:
        seed: the seed the rollouts were generated with.

    Example:
        >>> import torch
        >>> model = TinyLM(**POLICY_SHAPE)
        >>> SamplingPolicyInit(seed=0).setup(None, model, "fit")
        >>> torch.equal(model.body.embed.weight, sampling_policy(0).body.embed.weight.float())
        True
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def setup(self, trainer: L.Trainer | None, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        try:
            pl_module.load_state_dict(sampling_policy(self.seed).state_dict())
        except RuntimeError as err:
            detail = str(err).splitlines()[-1].strip()
            raise ConfigError(
                f"trainer.callbacks SamplingPolicyInit: the model ({type(pl_module).__name__}) does not have "
                f"the sampling policy's shape, a tied TinyLM {POLICY_SHAPE} ({detail})"
            ) from None


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lit_losses.data.rollouts``: write the example's records to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m lit_losses.data.rollouts", description=main.__doc__)
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-dtype",
        default=None,
        help="sample from the policy with weights in this dtype (old_logprobs)",
    )
    args = parser.parse_args(argv)
    for name in ("num_prompts", "group_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    dtype = getattr(torch, args.engine_dtype or "float64", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        parser.error(
            f"--engine-dtype={args.engine_dtype} is not a floating-point torch dtype (float8_e4m3fn)"
        )
    records = generate_rollouts(
        num_prompts=args.num_prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        engine_dtype=args.engine_dtype,
    )
    write_jsonl(records, args.out)
    mean_reward = math.fsum(r["reward"] for r in records) / len(records)
    print(f"wrote {len(records)} records to {args.out} (mean reward {mean_reward:.3f})")


if __name__ == "__main__":
    main()
