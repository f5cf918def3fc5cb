"""A small Hugging Face tokenizer with a ChatML chat template whose assistant turns are marked with
``{% generation %}`` (for ``assistant_only_loss``), trained on the shipped JSONL files.

``python -m tests.data.chat_tokenizer`` writes it to ``data/tokenizers/chatml-bpe`` (shipped).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data" / "tokenizers" / "chatml-bpe"
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML; the assistant's content and its ``<|im_end|>`` are inside the generation markers."""
PLAIN_CHATML = CHATML.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
"""The same template without generation markers."""


def corpus_texts() -> list[str]:
    """Every string of the shipped preference and SFT files (message contents included)."""
    texts = []
    for path in sorted((REPO / "data").glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            stack = [json.loads(line)]
            while stack:
                value = stack.pop()
                if isinstance(value, str):
                    texts.append(value)
                elif isinstance(value, dict):
                    stack.extend(value.values())
                elif isinstance(value, list):
                    stack.extend(value)
    return texts


def build(folder: Path, chat_template: str = CHATML, vocab_size: int = 700) -> str:
    """Train the byte-level BPE on `corpus_texts` and save it with ``chat_template`` in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus_texts(), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>", chat_template=chat_template
    )
    tok.save_pretrained(folder)
    return str(folder)


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED))
