"""Cost of regularizers on the tiny LM: CE-only step vs CE + three built-in terms, in one run.

The tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers, vocab 4096) on packed micro-batches of
4096 tokens (16 rows × 256). One "step" is ``compute_loss`` + ``backward`` of one micro-batch (the
optimizer update is the same in every variant). Variants are interleaved round-robin and the median
of ``--repeats`` is reported, so that machine noise hits them alike.

Variants:
  ce_only        the base cross-entropy alone (the head's plain-CE fast path)
  ce_logprobs    the base loss through the per-token head path (what any term needs), no term
  three_terms    base + z_loss + entropy (bonus) + logprob_l1, weights 1e-4 / 1e-2 / 1e-3
  three_no_entropy  base + z_loss + logprob_l1 + kl_reference (reference log-probs in the batch)

All built-ins are pointwise: with them the head evaluates the terms chunk by chunk and computes every
gradient in forward (`ChunkedPointwiseLoss`, three matmuls like the CE fast path). The entropy adds
three element-wise passes over each chunk of logits (its value and its gradient).

    python benchmarks/regularizers.py --repeats 20
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lit_losses import RegularizerSpec, TinyLM

THREE_TERMS = [
    RegularizerSpec(name="z_loss", weight=1e-4),
    RegularizerSpec(name="entropy", weight=1e-2, args={"mode": "bonus"}),
    RegularizerSpec(name="logprob_l1", weight=1e-3),
]
THREE_TERMS_NO_ENTROPY = [
    RegularizerSpec(name="z_loss", weight=1e-4),
    RegularizerSpec(name="logprob_l1", weight=1e-3),
    RegularizerSpec(name="kl_reference", weight=1e-2),
]


class ForcedLogprobs(TinyLM):
    def head_outputs_needed(self) -> tuple[str, ...]:
        return ("logprobs",)


def batch(rows: int = 16, width: int = 256, vocab: int = 4096) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    segment_ids = (torch.arange(width)[None] >= torch.randint(64, 192, (rows, 1), generator=g)).long() + 1
    position_ids = torch.where(
        segment_ids == 1,
        torch.arange(width),
        torch.arange(width) - (segment_ids == 2).long().argmax(1, keepdim=True),
    )
    ref_logprobs = -torch.rand(rows, width, generator=g) * 8
    return {
        "input_ids": ids,
        "labels": labels,
        "segment_ids": segment_ids,
        "position_ids": position_ids,
        "ref_logprobs": ref_logprobs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dims = dict(vocab_size=4096, d_model=192, n_layers=3, n_heads=3)
    torch.manual_seed(0)
    models = {
        "ce_only": TinyLM(**dims),
        "ce_logprobs": ForcedLogprobs(**dims),
        "three_terms": TinyLM(**dims, regularizers=THREE_TERMS),
        "three_no_entropy": TinyLM(**dims, regularizers=THREE_TERMS_NO_ENTROPY),
    }
    state = models["ce_only"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
    data = batch()
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(args.repeats + 2):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model.compute_loss(data).total.backward()
            if r >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    print(
        f"{platform.machine()} · torch {torch.__version__} · {torch.get_num_threads()} threads · "
        f"repeats {args.repeats}"
    )
    base = statistics.median(times["ce_only"])
    print("| variant | median step (ms) | / ce_only |")
    print("|---|---:|---:|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
