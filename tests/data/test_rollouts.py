"""The RL example's generator (`lit_losses.data.rollouts`): deterministic for a seed; its stored
log-probabilities are the policy's own, recomputed here by a naive float64 forward; rewards and GRPO
advantages recomputed from the text; the committed ``data/rollouts.jsonl`` is what it generates."""

from __future__ import annotations

import json
import statistics
import string
from pathlib import Path

import pytest
import torch

from lit_losses import TinyLM
from lit_losses.data import read_jsonl
from lit_losses.data.rollouts import generate_rollouts, main

REPO = Path(__file__).resolve().parents[2]
ALPHABET = string.ascii_lowercase + " .,?!"  # ids 1.., 0 = end of completion


def naive_logprobs(tokens: list[int], seed: int) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1 under the documented policy: a TinyLM(32, 64, 2 layers,
    4 heads) built under torch.manual_seed(seed), in float64, logits = hidden · embeddingᵀ."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(vocab_size=32, d_model=64, n_layers=2, n_heads=4).double()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = model.body(ids)[0]
        logits = hidden @ model.body.embed.weight.T
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]


def test_generator_is_deterministic_for_a_seed():
    a = generate_rollouts(num_prompts=3, group_size=3, max_new_tokens=6, seed=1)
    b = generate_rollouts(num_prompts=3, group_size=3, max_new_tokens=6, seed=1)
    c = generate_rollouts(num_prompts=3, group_size=3, max_new_tokens=6, seed=2)
    assert a == b and a != c
    assert len(a) == 9 and all(len(r["tokens"]) <= 7 + 6 for r in a)


@pytest.mark.parametrize("seed", [0, 5])
def test_stored_logprobs_are_the_policys_own(seed):
    records = generate_rollouts(num_prompts=4, group_size=2, max_new_tokens=8, seed=seed)
    for record in records:
        reference = naive_logprobs(record["tokens"], seed)
        stored = record["logprobs"][1:]
        completion = [i for i, lp in enumerate(stored) if lp is not None]
        assert completion and completion == list(range(completion[0], len(stored)))  # prompt, then completion
        got = torch.tensor([stored[i] for i in completion], dtype=torch.float64)
        torch.testing.assert_close(got, reference[completion], rtol=0, atol=1e-8)  # 8 decimals kept
        assert record["ref_logprobs"] == record["logprobs"]  # the reference is the same initial model


def test_rewards_and_group_advantages_follow_the_documented_rule():
    records = generate_rollouts(num_prompts=6, group_size=4, max_new_tokens=10, seed=3)
    for start in range(0, len(records), 4):
        group = records[start : start + 4]
        rewards = []
        for record in group:
            prompt, _, completion = record["text"].partition("?")
            completion = completion.removesuffix("<end>")
            assert record["tokens"][: len(prompt) + 1] == [1 + ALPHABET.index(c) for c in prompt + "?"]
            expected = sum(c in prompt for c in completion) / len(completion) if completion else 0.0
            assert record["reward"] == pytest.approx(expected, abs=1e-12)
            rewards.append(expected)
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        for record, r in zip(group, rewards):
            assert record["advantage"] == pytest.approx((r - mean) / (std + 1e-6), abs=1e-8)


def test_committed_example_file_is_what_the_generator_writes(tmp_path):
    main(["--out", str(tmp_path / "r.jsonl"), "--num-prompts", "96", "--group-size", "4", "--seed", "0"])
    fresh = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    committed = [json.loads(line) for line in (REPO / "data" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in committed] == [r["tokens"] for r in fresh]
    for old, new in zip(committed, fresh):
        for key in ("logprobs", "ref_logprobs"):
            assert [a is None for a in old[key]] == [b is None for b in new[key]]
            assert max(abs(a - b) for a, b in zip(old[key], new[key]) if a is not None) <= 2e-8
        assert abs(old["advantage"] - new["advantage"]) <= 2e-8
    rows = read_jsonl(str(REPO / "data" / "rollouts.jsonl"), vocab_size=32, seq_len=24)
    assert len(rows) == 384


def test_generator_cli_refuses_a_bad_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "unused.jsonl", "--num-prompts", "0"])
    assert exit_info.value.code == 2
    assert "--num-prompts=0 must be >= 1" in capsys.readouterr().err


def test_committed_engine_file_starts_with_what_the_generator_writes():
    """``data/rollouts_fp8.jsonl``'s first two prompts, generated again: the engine (FP8 weights) sampled
    the tokens and gave ``logprobs``; the float64 policy gives ``old_logprobs`` and ``ref_logprobs``."""
    fresh = generate_rollouts(num_prompts=2, group_size=4, seed=0, engine_dtype="float8_e4m3fn")
    lines = (REPO / "data" / "rollouts_fp8.jsonl").read_text().splitlines()
    committed = [json.loads(line) for line in lines[: len(fresh)]]
    assert len(lines) == 192 and [r["tokens"] for r in committed] == [r["tokens"] for r in fresh]
    for old, new in zip(committed, fresh, strict=True):
        for key in ("logprobs", "old_logprobs", "ref_logprobs"):
            assert max(abs(a - b) for a, b in zip(old[key], new[key]) if a is not None) <= 2e-8
    for record in fresh:
        start = next(i for i, lp in enumerate(record["logprobs"]) if lp is not None)
        trainer = naive_logprobs(record["tokens"], seed=0)[start - 1 :].tolist()
        assert max(abs(a - b) for a, b in zip(record["old_logprobs"][start:], trainer)) <= 1e-8
        gap = max(abs(a - b) for a, b in zip(record["old_logprobs"][start:], record["logprobs"][start:]))
        assert 0 < gap < 0.1  # the engine is not the trainer, and not far from it
    rows = read_jsonl(str(REPO / "data" / "rollouts_fp8.jsonl"), vocab_size=32, seq_len=24)
    assert all("old_logprobs" in row.fields for row, _ in rows)
