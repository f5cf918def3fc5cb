"""LoRA fine-tuning of a (tiny) Hugging Face model through the fused head, with ``z_loss`` and ``entropy``.

Everything is local: the script first makes a "pretrained" checkpoint (a tiny Llama built from its config
and saved with ``save_pretrained``) and a tokenizer (a byte-level BPE trained on a few standard-library
files, saved as a ``PreTrainedTokenizerFast`` directory). Then, as with a real checkpoint:

* ``HFTextDataModule`` tokenizes local text files with that tokenizer and packs them into micro-batches;
* ``HFCausalLM(model_name_or_path=..., lora=...)`` wraps the model with ``peft`` (only the adapters train;
  the frozen output weight costs the fused head no gradient);
* the loss is ``CE + 1e-4 · lse² − 0.01 · H`` (z-loss and an entropy bonus), computed chunk by chunk
  without ``[tokens × vocab]`` logits, in ``bf16-mixed`` precision.

    python examples/hf_lora.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning as L
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from lit_losses import HFCausalLM
from lit_losses.data import stdlib_sources
from lit_losses.data.hf_text import HFTextDataModule


def make_tokenizer(texts: list[str], folder: Path, vocab_size: int = 512) -> str:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|eos|>", "<|pad|>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eos|>", pad_token="<|pad|>").save_pretrained(
        folder
    )
    return str(folder)


def make_checkpoint(vocab_size: int, folder: Path) -> str:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def main(steps: int = 6, workdir: str | None = None) -> dict:
    """Fine-tune for ``steps`` optimizer steps; returns the last step's telemetry."""
    folder = Path(workdir or tempfile.mkdtemp())
    files = stdlib_sources()[:12]
    for i, src in enumerate(files):
        (folder / f"doc{i}.txt").write_text(Path(src).read_text(encoding="utf-8"), encoding="utf-8")
    tokenizer = make_tokenizer([Path(f).read_text(encoding="utf-8") for f in files], folder / "tokenizer")
    checkpoint = make_checkpoint(
        len(PreTrainedTokenizerFast.from_pretrained(tokenizer)), folder / "checkpoint"
    )

    data = HFTextDataModule(
        tokenizer, paths=[str(folder / "*.txt")], seq_len=128, tokens_per_batch=512, val_fraction=0.0
    )
    model = HFCausalLM(
        model_name_or_path=checkpoint,
        lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        regularizers=[
            {"name": "z_loss", "weight": 1e-4},
            {"name": "entropy", "weight": 0.01, "args": {"mode": "bonus"}},
        ],
        optimizer={"lr": 3e-3, "warmup_steps": 0},
    )
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(folder),
    )
    trainer.fit(model, data)
    unchanged = all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    telemetry = model.telemetry
    print(f"trained {trainable} of {total} parameters (LoRA); base weights unchanged: {unchanged}")
    terms = {name: round(t["value"], 4) for name, t in telemetry["regularizers"].items()}
    print(
        f"last step: loss {telemetry['loss_total']:.4f}, base {telemetry['base_loss']['value']:.4f}, {terms}"
    )
    return {**telemetry, "base_unchanged": unchanged}


if __name__ == "__main__":
    main()
