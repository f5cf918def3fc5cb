import torch

from lit_losses.data.packing import EpochShuffleSampler, MicroBatchDataset, Pieces, batch_rows, pack_rows


def make_pieces(doc_lengths, seq_len, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in doc_lengths]
    return docs, Pieces.from_documents(docs, seq_len)


def test_long_documents_are_cut_into_pieces_of_at_most_seq_len():
    docs, pieces = make_pieces([5, 23, 8], seq_len=8)
    assert pieces.lengths.tolist() == [5, 8, 8, 7, 8]
    assert pieces.tokens.tolist() == sum(docs, [])


def test_labels_are_next_tokens_within_a_document_and_masked_at_boundaries():
    docs, pieces = make_pieces([3, 4, 2], seq_len=16)
    ds = MicroBatchDataset(pieces, seq_len=16, tokens_per_batch=64, packing=True, pad_id=999)
    batch = ds[0]
    assert batch["input_ids"].shape == (1, 9)
    a, b, c = docs
    assert batch["input_ids"][0].tolist() == a + b + c
    assert batch["labels"][0].tolist() == a[1:] + [-100] + b[1:] + [-100] + c[1:] + [-100]
    assert batch["segment_ids"][0].tolist() == [1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]


def test_padding_gets_segment_zero_and_no_label():
    _, pieces = make_pieces([6, 6, 3], seq_len=8)
    ds = MicroBatchDataset(pieces, seq_len=8, tokens_per_batch=32, packing=False, pad_id=999)
    batch = ds[0]
    short = batch["segment_ids"] == 0
    assert short.any()
    assert (batch["labels"][short] == -100).all() and (batch["input_ids"][short] == 999).all()


def test_no_micro_batch_exceeds_the_budget_and_every_token_appears_once():
    lengths = torch.randint(1, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    for packing in (True, False):
        docs, pieces = make_pieces(lengths, seq_len=64, seed=3)
        ds = MicroBatchDataset(pieces, seq_len=64, tokens_per_batch=256, packing=packing, pad_id=-1)
        rows_per_batch = set()
        seen = []
        for i in EpochShuffleSampler(len(ds), seed=5):
            batch = ds[i]
            assert batch["input_ids"].numel() <= 256
            rows_per_batch.add(batch["input_ids"].shape[0])
            seen.append(batch["input_ids"][batch["segment_ids"] > 0])
        assert sorted(torch.cat(seen).tolist()) == sorted(sum(docs, []))
        assert len(rows_per_batch) > 1 or packing  # variable-length rows give varying row counts


def test_packing_holds_varying_numbers_of_sequences_per_micro_batch():
    lengths = torch.randint(1, 120, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    _, pieces = make_pieces(lengths, seq_len=128)
    ds = MicroBatchDataset(pieces, seq_len=128, tokens_per_batch=512, packing=True, pad_id=0)
    n_segments = {int(ds[i]["segment_ids"].amax(-1).sum()) for i in range(len(ds))}
    assert len(n_segments) > 1


def test_pack_rows_never_overfills_a_row():
    lengths = [5, 3, 8, 1, 7, 2, 8]
    rows = pack_rows(lengths, seq_len=8, packing=True)
    assert sorted(sum(rows, [])) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)


def test_batch_rows_respects_budget():
    batches = batch_rows([8, 8, 8, 3, 8], tokens_per_batch=16)
    assert batches == [[0, 1], [2, 3], [4]]


def test_epoch_shuffle_depends_only_on_seed_and_epoch():
    s1, s2 = EpochShuffleSampler(50, seed=1), EpochShuffleSampler(50, seed=1)
    assert list(s1) == list(s2)
    s2.set_epoch(1)
    assert list(s1) != list(s2) and sorted(s2) == list(range(50))
