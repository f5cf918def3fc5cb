"""The package's own offline RL example: completions sampled from a seeded `TinyLM`, with their own
log-probabilities and a rule-based reward, written as JSONL records (`lit_losses.data.rl_records`).

    python -m lit_losses.data.rollouts --out data/rollouts.jsonl --num-prompts 96 --group-size 4 --seed 0

- **Vocabulary** (characters, `VOCAB_SIZE` = 32): ``0`` end of completion (also the padding input of
  `RLDataModule`, ``pad_id=0``), ``1..26`` ``a..z``, then space, ``.``, ``,``, ``?``, ``!``.
- **Prompts**: a random word of 3 to 6 letters followed by ``?`` (drawn with ``seed``).
- **Policy**: ``TinyLM(vocab_size=32, d_model=64, n_layers=2, n_heads=4)`` initialized under
  ``torch.manual_seed(seed)`` and run in float64, so that neither the sampled tokens nor their
  log-probabilities depend on the machine's float32 reductions.
- **Completions**: ``group_size`` per prompt, sampled at temperature 1 until the end token or
  ``max_new_tokens``; ``logprobs`` holds ``log π(token | prefix)`` of each sampled token (null for the
  prompt), ``ref_logprobs`` the same initial model's (the reference policy of ``kl_reference``).
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
    num_prompts: int = 96, group_size: int = 4, max_new_tokens: int = 16, seed: int = 0
) -> list[dict[str, Any]]:
    """The example's records (flat form), ``group_size`` consecutive records per prompt.

    Example:
        >>> records = generate_rollouts(num_prompts=2, group_size=2, max_new_tokens=4)
        >>> len(records), sorted(records[0])
        (4, ['advantage', 'logprobs', 'ref_logprobs', 'reward', 'text', 'tokens'])
    """
    model = sampling_policy(seed)
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(num_prompts):
        length = int(torch.randint(3, 7, (1,), generator=generator))
        word = torch.randint(0, 26, (length,), generator=generator).tolist()
        prompt = encode("".join(string.ascii_lowercase[i] for i in word) + "?")
        group = sample_group(model, prompt, group_size, max_new_tokens, generator)
        rewards = [reward(prompt, completion) for completion, _ in group]
        for (completion, logprobs), r, adv in zip(group, rewards, group_advantages(rewards), strict=True):
            lps = [None] * len(prompt) + [round(lp, DIGITS) for lp in logprobs]
            tokens, advantage = prompt + completion, round(adv, DIGITS)
            records.append(
                {
                    "tokens": tokens,
                    "logprobs": lps,
                    "ref_logprobs": list(lps),
                    "advantage": advantage,
                    "reward": r,
                    "text": decode(tokens),
                }
            )
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
    args = parser.parse_args(argv)
    for name in ("num_prompts", "group_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    records = generate_rollouts(args.num_prompts, args.group_size, args.max_new_tokens, args.seed)
    write_jsonl(records, args.out)
    mean_reward = math.fsum(r["reward"] for r in records) / len(records)
    print(f"wrote {len(records)} records to {args.out} (mean reward {mean_reward:.3f})")


if __name__ == "__main__":
    main()
