"""Cost of the structured-regularizer form ``fn(data, logprobs_list)`` against the ``fn(ctx)`` form.

The tiny LM of ``configs/tiny_lm.yaml`` (d_model 192, 3 layers, vocab 4096) on packed micro-batches of
4096 tokens (16 rows × 256). One "step" is ``compute_loss`` + ``backward``. Every variant computes the
same penalty, the mean over sequences of ``‖log p‖₁`` (weight 0.01), on top of the base loss; variants
are interleaved round-robin and the median of ``--repeats`` is reported.

Second table: the terms alone (`RegularizerSet` + backward on fixed per-token log-probabilities that
require grad, no model), i.e. the overhead of each form, in microseconds per call.

Variants:
  ce_logprobs      the base loss through the per-token head path, no term (the baseline)
  ctx_matrix       ``fn(ctx)`` returning ``|log p|`` per token, aggregated ``seq-mean-token-sum``
  design           ``fn(data, logprobs_list)``: one `Datum` and one aligned tensor per sequence
  design_thread    the same with ``run_in_executor: true``
  design_async     the same as an ``async def``
  design_many_seqs ``design`` on rows of 16 documents each (256 sequences instead of 32)

    python benchmarks/structured_regularizers.py --repeats 15 [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lit_losses import TinyLM
from lit_losses.aggregation import GlobalStats
from lit_losses.heads import HeadOutput
from lit_losses.loss import LossContext
from lit_losses.regularizers import RegularizerSet


def l1_ctx(ctx):
    return ctx.logprobs.abs()


def l1_design(data, logprobs_list):
    return torch.stack([lp.abs().sum() for lp in logprobs_list]).mean(), {}


async def l1_async(data, logprobs_list):
    return l1_design(data, logprobs_list)


class ForcedLogprobs(TinyLM):
    def head_outputs_needed(self) -> tuple[str, ...]:
        return ("logprobs",)


def batch(documents_per_row: int, rows: int = 16, width: int = 256, vocab: int = 4096) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    labels = torch.roll(ids, -1, 1)
    length = width // documents_per_row
    segment_ids = torch.arange(width).div(length, rounding_mode="floor").expand(rows, width) + 1
    position_ids = torch.arange(width).remainder(length).expand(rows, width)
    labels[position_ids == length - 1] = -100  # no target across documents
    return {"input_ids": ids, "labels": labels, "segment_ids": segment_ids, "position_ids": position_ids}


def term_overhead(specs: list[dict], data: dict, repeats: int) -> float:
    """Median seconds of one `RegularizerSet` call + backward on fixed log-probabilities."""
    terms = RegularizerSet(specs, default_agg="seq-mean-token-sum")
    mask = data["labels"] != -100
    stats = GlobalStats.local_only(data)
    out = []
    for r in range(repeats + 5):
        logprobs = (-torch.rand(mask.shape) * 8 * mask).requires_grad_()
        ctx = LossContext(data, HeadOutput(logprobs=logprobs), None, mask, stats, 0, "train")
        start = time.perf_counter()
        terms(ctx)[0].backward()
        if r >= 5:
            out.append(time.perf_counter() - start)
    terms.close()
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = dict(vocab_size=4096, d_model=192, n_layers=3, n_heads=3, loss_agg="seq-mean-token-sum")
    term = {"name": "l1", "weight": 0.01}
    torch.manual_seed(0)
    variants = {
        "ce_logprobs": (ForcedLogprobs(**dims), 2),
        "ctx_matrix": (TinyLM(**dims, regularizers=[{**term, "fn": l1_ctx}]), 2),
        "design": (TinyLM(**dims, regularizers=[{**term, "fn": l1_design}]), 2),
        "design_thread": (
            TinyLM(**dims, regularizers=[{**term, "fn": l1_design, "run_in_executor": True}]),
            2,
        ),
        "design_async": (TinyLM(**dims, regularizers=[{**term, "fn": l1_async}]), 2),
        "design_many_seqs": (TinyLM(**dims, regularizers=[{**term, "fn": l1_design}]), 16),
    }
    state = variants["ce_logprobs"][0].state_dict()
    for model, _ in variants.values():
        model.load_state_dict(state)
    data = {n: batch(docs) for n, (_, docs) in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.repeats + 2):
        for name, (model, _) in variants.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model.compute_loss(data[name]).total.backward()
            if r >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    print(
        f"{platform.machine()} · torch {torch.__version__} · {torch.get_num_threads()} threads · "
        f"repeats {args.repeats}"
    )
    base = statistics.median(times["ce_logprobs"])
    print("| variant | median step (ms) | / ce_logprobs |")
    print("|---|---:|---:|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f} |")
    print("\n| terms alone (sequences) | median call + backward (µs) |")
    print("|---|---:|")
    for name, (model, docs) in variants.items():
        specs = [s for s in model.hparams.get("regularizers") or []]
        if specs:
            seconds = term_overhead(specs, batch(docs), 10 * args.repeats)
            print(f"| {name} ({16 * docs}) | {seconds * 1e6:.0f} |")


if __name__ == "__main__":
    main()
