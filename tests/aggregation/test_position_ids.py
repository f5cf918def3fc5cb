"""Sequences from ``position_ids`` restarts when a batch has no ``segment_ids`` (Hugging Face's packed
format): counts and ``seq-*`` weights equal those of the same documents in separate rows."""

import torch

from lit_losses.aggregation import count_masks, sequence_ids, token_weights
from lit_losses.aggregation.stats import batch_segment_ids, segments_from_positions

LENGTHS = [3, 5, 2]


def flattened():
    """Three documents in one row, positions restarting at 0, labels ignored at each document's start."""
    labels = torch.cat([torch.tensor([-100] + [7] * (n - 1)) for n in LENGTHS])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return {"labels": labels, "position_ids": positions}


def separate():
    T = max(LENGTHS)
    labels = torch.full((len(LENGTHS), T), -100)
    for i, n in enumerate(LENGTHS):
        labels[i, 1:n] = 7
    return {"labels": labels}


def test_segments_start_wherever_a_position_is_not_the_previous_plus_one():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [3, 4, 5, 6, 0, 1, 2]])
    assert segments_from_positions(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 1, 1, 1]]


def test_segment_ids_win_over_position_ids_and_neither_means_one_sequence_per_row():
    mask = torch.ones(1, 4, dtype=torch.bool)
    segs, pos = torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 1, 0, 1]])
    assert sequence_ids(mask, segs, pos).tolist() == [[0, 0, 0, 0]]
    assert sequence_ids(mask, None, pos).tolist() == [[0, 0, 1, 1]]
    assert batch_segment_ids({"segment_ids": segs, "position_ids": pos}) is segs
    assert batch_segment_ids({"labels": mask}) is None


def test_flattened_documents_are_counted_like_separate_rows():
    flat, rows = count_masks(flattened())["labels"], count_masks(separate())["labels"]
    assert flat == rows
    assert (flat.num_tokens, flat.num_sequences) == (sum(LENGTHS) - 3, 3)


def test_seq_mean_token_mean_weights_follow_the_documents():
    batch = flattened()
    mask = batch["labels"] != -100
    stats = count_masks(batch)["labels"]
    w = token_weights(mask, "seq-mean-token-mean", stats, batch_segment_ids(batch), torch.float64)
    expected = torch.cat([torch.tensor([0.0] + [1 / (3 * (n - 1))] * (n - 1)) for n in LENGTHS]).double()
    torch.testing.assert_close(w[0], expected)
    rows_w = token_weights(separate()["labels"] != -100, "seq-mean-token-mean", stats, None, torch.float64)
    torch.testing.assert_close(w.sum(), rows_w.sum())
