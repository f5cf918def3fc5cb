"""A whole TRL training run and the same run through ``lit-losses fit``, step by step.

`trl_train` runs a TRL trainer's own ``train()`` (transformers' loop: its optimizer, scheduler, gradient
accumulation with ``num_items_in_batch``, clipping and logging) and records every micro-batch it trained
on, in its order, with the global token count transformers normalized it by. Those micro-batches, rebuilt
through this package's collation (`sft_batch`; `trl_dpo.lit_batch` for preference pairs), go to a file
that `TRLMicroBatches` (a data module for the CLI) serves in the same order. `lit_run` runs ``lit-losses
fit`` on a YAML of the ``trainer`` and ``model`` options that docs/coming-from-trl.md maps TRL's
arguments to; its `StepRecord` callback records what each optimizer step did: the loss, the learning rate
and the gradient norm before clipping.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from datasets import Dataset, disable_progress_bars
from torch import Tensor

from lit_losses import GlobalStatsLoader
from lit_losses.cli.app import cli_main
from lit_losses.data.datamodule import FileDataModule
from lit_losses.data.packing import Pieces, collate_rows
from tests.cli_runs import read_scalars, run_folder
from tests.objectives import peer_trainers as peers


class TRLMicroBatches(FileDataModule):
    """The micro-batches of a TRL run (a ``torch.save`` file of a list of dicts), served in their order.

    Args:
        paths: the files, read in order.
        vocab_size: the model's vocabulary (the data→model link of the CLI).
    """

    paths_hint = "give the torch file of the micro-batches"

    def __init__(self, paths: list[str] | None, vocab_size: int | None = None) -> None:
        super().__init__(paths, val_fraction=0.0, seed=0, num_workers=0)
        self.vocab_size = vocab_size

    def read_items(self) -> list[dict[str, Tensor]]:
        return [batch for src in self.sources for batch in torch.load(src)]

    def build_dataset(self, items: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        return items

    def train_dataloader(self) -> GlobalStatsLoader:
        """The micro-batches in the file's order (TRL's), with their optimizer step's global counts."""
        return GlobalStatsLoader(self.train_set, batch_size=None)


def sft_batch(batch: dict[str, Tensor], pad_id: int) -> dict[str, Tensor]:
    """SFTTrainer's collated micro-batch (right-padded rows, labels aligned with ``input_ids``, ``-100`` on
    the prompt and the padding) through `collate_rows`, the collation of `lit_losses.data.HFTextDataModule`
    without packing: one row per record, next-token labels where TRL's labels train a token."""
    keep = batch["attention_mask"]
    rows = [
        peers.next_token_row(ids, [label != peers.IGNORE for label in labels])
        for ids, labels in zip(
            peers.unpadded(batch["input_ids"], keep), peers.unpadded(batch["labels"], keep), strict=True
        )
    ]
    pieces = Pieces.from_sequences([ids for ids, _ in rows], [labels for _, labels in rows], fields={})
    return collate_rows(pieces, [[i] for i in range(len(rows))], pad_id=pad_id)


class StepRecord(L.Callback):
    """Each optimizer step's loss (``train/loss_total``, logged or not), learning rate and gradient norm
    before clipping; at the start of the fit, the trainable weights of ``initial_weights`` (a
    ``torch.save`` file of a state dict of the Hugging Face model) are copied in, so that both runs start
    from the same LoRA adapters.

    Args:
        initial_weights: the file of the starting weights (by name of the wrapped model), or ``None``.
    """

    def __init__(self, initial_weights: str | None = None) -> None:
        self.initial_weights = initial_weights
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.grad_norms: list[float] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.initial_weights is None:
            return
        weights = torch.load(self.initial_weights)
        params = dict(pl_module.model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        if len(self.losses) < len(self.lrs):  # the window's last micro-batch: the step is logged
            self.losses.append(float(pl_module.telemetry["loss_total"]))


def trl_trainer(
    trainer_cls: type,
    config_cls: type,
    *,
    records: list[dict],
    model: Any,
    out_dir: Path,
    ref_model: Any = None,
    peft_config: Any = None,
    **fields: Any,
) -> Any:
    """A TRL trainer on CPU over ``records`` in order (``train_sampling_strategy="sequential"``), with the
    config ``fields`` (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ...)."""
    disable_progress_bars()
    args = config_cls(
        output_dir=str(out_dir),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        train_sampling_strategy="sequential",
        **fields,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(records),
            processing_class=peers.tokenizer(),
            **({} if ref_model is None else {"ref_model": ref_model}),
            **({} if peft_config is None else {"peft_config": peft_config}),
        )


def trl_train(trainer: Any) -> tuple[list[tuple[dict[str, Any], Any]], dict[str, Tensor]]:
    """Run TRL's ``trainer.train()``.

    Returns:
        ``(micro_batches, initial)``: each micro-batch it trained on, in order, with the
        ``num_items_in_batch`` transformers normalized it by, and the trainable weights before training
        (by name of the trainer's model).
    """
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    seen: list[tuple[dict[str, Any], Any]] = []
    step = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        seen.append((copy.deepcopy(dict(inputs)), num_items_in_batch))
        return step(model, inputs, num_items_in_batch)

    trainer.training_step = training_step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return seen, initial


def trl_steps(trainer: Any) -> list[dict[str, float]]:
    """The per-step entries of the trainer's ``log_history`` (``loss``, ``learning_rate``, ``grad_norm``)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def lit_run(folder: Path, config: dict[str, Any], *args: str) -> tuple[Any, StepRecord, dict]:
    """``lit-losses fit`` on ``config`` (written to ``folder/run.yaml``) and the extra ``args``.

    Returns:
        ``(cli, record, scalars)``: the CLI object, the `StepRecord` of the run, and every scalar it logged
        (tag → {step: value}).
    """
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = cli_main(["fit", "--config", str(path), *args])
    (record,) = [c for c in cli.trainer.callbacks if isinstance(c, StepRecord)]
    return cli, record, read_scalars(run_folder(folder / "logs"))
