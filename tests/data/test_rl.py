"""`RLDataModule` / `rl_dataset`: RL records packed into micro-batches keep every per-token field aligned
with its tokens, across packed segments and padding; the loader's global counts are the records'
targets; configuration and record errors stop the CLI with one line naming the file and line."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_losses import TinyLM
from lit_losses.aggregation import GlobalStatsLoader
from lit_losses.cli.app import cli_main
from lit_losses.data import RLDataModule, rl_dataset
from lit_losses.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")

REPO = Path(__file__).resolve().parents[2]
V, N = 50, -100


def random_records(count: int, seed: int = 0, max_len: int = 12) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        n = rng.randint(2, max_len)
        prompt = rng.randint(1, n - 1)
        mask = [0] * prompt + [1] * (n - prompt)
        record = {
            "tokens": [rng.randrange(V) for _ in range(n)],
            "logprobs": [None] * prompt + [-rng.random() * 5 for _ in range(n - prompt)],
            "ref_logprobs": [None] * prompt + [-rng.random() * 5 for _ in range(n - prompt)],
            "advantages": [None] * prompt + [rng.gauss(0, 1) for _ in range(n - prompt)],
            "weights": [0.0] * prompt + [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(n - prompt)],
            "completion_mask": mask,
            "sample_weight": rng.choice([0.5, 1.0, 3.0]),
        }
        record["weights"][-1] = 1.0  # at least one target
        records.append(record)
    return records


def expected_segment(record: dict) -> tuple:
    """The row of a record, written out naively: position t describes tokens[t + 1]."""
    tokens, n = record["tokens"], len(record["tokens"])
    on = [bool(record["completion_mask"][j]) and record["weights"][j] != 0 for j in range(1, n)]
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731 - values travel as float32

    def col(values):
        return tuple(f32(values[t + 1]) if on[t] else 0.0 for t in range(n - 1))

    sample = tuple(f32(record["sample_weight"]) if on[t] else 0.0 for t in range(n - 1))
    return (
        tuple(tokens[:-1]),
        tuple(tokens[t + 1] if on[t] else N for t in range(n - 1)),
        col(record["logprobs"]),
        col(record["advantages"]),
        col(record["weights"]),
        sample,
        col(record["ref_logprobs"]),
    )


KEYS = (
    "input_ids",
    "labels",
    "sampling_logprobs",
    "advantages",
    "loss_weights",
    "sample_weights",
    "ref_logprobs",
)


@pytest.mark.parametrize("packing", [True, False])
def test_packing_keeps_every_field_aligned_with_its_tokens_across_segments(packing):
    records = random_records(80)
    dataset = rl_dataset(records, seq_len=16, tokens_per_batch=48, vocab_size=V, packing=packing)
    expected = Counter(expected_segment(r) for r in records)
    seen: Counter = Counter()
    segments_per_row = set()
    for i in range(len(dataset)):
        batch = dataset[i]
        assert sorted(batch) == sorted([*KEYS, "segment_ids", "position_ids"])
        assert batch["input_ids"].numel() <= 48
        for b in range(batch["input_ids"].shape[0]):
            seg = batch["segment_ids"][b]
            segments_per_row.add(int(seg.max()))
            pad = seg == 0
            assert (batch["labels"][b][pad] == N).all()
            for key in KEYS[2:]:
                assert (batch[key][b][pad] == 0).all() and batch[key].dtype == torch.float32
            for s in seg.unique().tolist():
                if s == 0:
                    continue
                at = seg == s
                assert batch["position_ids"][b][at].tolist() == list(range(int(at.sum())))
                seen[tuple(tuple(batch[key][b][at].tolist()) for key in KEYS)] += 1
    assert seen == expected  # every record once, every field at its token
    assert (max(segments_per_row) > 1) == packing


def write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_data_module_splits_shuffles_and_serves_global_counts_of_the_records_targets(tmp_path):
    records = random_records(60, seed=1)
    path = write(tmp_path / "r.jsonl", records)
    data = RLDataModule(paths=[path], vocab_size=V, seq_len=16, tokens_per_batch=48, val_fraction=0.2, seed=3)
    data.setup("fit")
    targets = lambda ds: sum(int((ds[i]["labels"] != N).sum()) for i in range(len(ds)))  # noqa: E731
    expected_targets = sum(sum(1 for t in expected_segment(r)[1] if t != N) for r in records)
    assert targets(data.train_set) + targets(data.val_set) == expected_targets
    val_segments = sum(int(data.val_set[i]["segment_ids"].amax(-1).sum()) for i in range(len(data.val_set)))
    assert val_segments == 12  # round(60 × 0.2) records held out

    again = RLDataModule(
        paths=[path], vocab_size=V, seq_len=16, tokens_per_batch=48, val_fraction=0.2, seed=3
    )
    again.setup("fit")
    assert torch.equal(again.train_set[0]["advantages"], data.train_set[0]["advantages"])
    other = RLDataModule(
        paths=[path], vocab_size=V, seq_len=16, tokens_per_batch=48, val_fraction=0.2, seed=4
    )
    other.setup("fit")
    assert not torch.equal(other.val_set[0]["input_ids"], data.val_set[0]["input_ids"])

    loader = data.train_dataloader()
    assert isinstance(loader, GlobalStatsLoader)
    loader.configure(accumulate_grad_batches=2, mask_keys=["labels"], ignore_index=N)
    batches = list(loader)
    for k in range(0, len(batches) - 1, 2):
        window = batches[k : k + 2]
        total = sum(int((b["labels"] != N).sum()) for b in window)
        assert all(b["global_stats"].get("labels").num_tokens == total for b in window)

    limited = RLDataModule(paths=[path], vocab_size=V, seq_len=16, tokens_per_batch=48, max_records=7)
    limited.setup("fit")
    assert (
        sum(int(limited.train_set[i]["segment_ids"].amax(-1).sum()) for i in range(len(limited.train_set)))
        == 7
    )


def test_trainer_fit_on_rl_batches_with_a_kl_reference_term(tmp_path):
    path = write(tmp_path / "r.jsonl", random_records(24, seed=2))
    data = RLDataModule(paths=[path], vocab_size=V, seq_len=16, tokens_per_batch=64)
    model = TinyLM(
        vocab_size=V,
        d_model=16,
        n_layers=1,
        n_heads=2,
        regularizers=[{"name": "kl_reference", "weight": 0.1}],
    )
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 2
    assert model.telemetry["regularizers"]["kl_reference"]["value"] > 0


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"paths": None}, "data.paths: give the JSONL files of RL records"),
        ({"pad_id": 50}, "data.pad_id=50 must be a token id in [0, 50)"),
        ({"max_records": 0}, "data.max_records=0 must be >= 1"),
        ({"vocab_size": 0}, "data.vocab_size=0 must be >= 1"),
        ({"seq_len": 1}, "data.seq_len=1 must be >= 2"),
        ({"paths": ["/nowhere/*.jsonl"]}, "data.paths entry '/nowhere/*.jsonl' matches no file"),
    ],
)
def test_bad_options_are_config_errors_naming_the_option(tmp_path, kwargs, expected):
    options = {"paths": [write(tmp_path / "r.jsonl", random_records(2))], "vocab_size": V, **kwargs}
    with pytest.raises(ConfigError) as err:
        RLDataModule(**options)
    assert expected in str(err.value)


def test_an_empty_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    data = RLDataModule(paths=[str(tmp_path / "empty.jsonl")], vocab_size=V)
    with pytest.raises(ConfigError, match=r"data\.paths: no record in 1 file"):
        data.setup("fit")


@pytest.mark.timeout(120)
def test_cli_stops_on_a_bad_record_with_one_line_naming_file_and_line(tmp_path, capsys):
    records = random_records(5, seed=3)
    records[3]["logprobs"][-1] = 0.25
    path = write(tmp_path / "r.jsonl", records)
    args = [
        "fit",
        "--data=lit_losses.data.RLDataModule",
        f"--data.init_args.paths=[{path}]",
        f"--data.init_args.vocab_size={V}",
        "--model.init_args.d_model=16",
        "--model.init_args.n_heads=2",
        "--model.init_args.n_layers=1",
        "--trainer.max_steps=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"lit-losses: error: {path}:4: logprobs[")
    assert "is > 0, not a log-probability" in err[0]
