"""`EpochShuffleSampler` under data parallelism: shards of one seeded permutation per epoch, which Lightning
keeps (it is a DistributedSampler) and sets the epoch of."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lit_losses.data.packing import EpochShuffleSampler


def test_ranks_share_one_permutation_per_epoch():
    for epoch in (0, 1):
        full = EpochShuffleSampler(11, seed=3)
        full.set_epoch(epoch)
        shards = []
        for rank in range(3):
            sampler = EpochShuffleSampler(11, seed=3, num_replicas=3, rank=rank)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        order = list(full)
        padded = order + order[:1]  # 12 = 3 x 4: the first index again, as DistributedSampler pads
        assert shards == [padded[r::3] for r in range(3)]
        assert all(len(s) == len(sampler) == 4 for s in shards)
    assert list(EpochShuffleSampler(11, seed=3)) != order  # epoch 1 differs from epoch 0


def test_lightning_keeps_the_sampler_under_ddp():
    sampler = EpochShuffleSampler(8, seed=0, num_replicas=2, rank=1)
    assert isinstance(sampler, torch.utils.data.DistributedSampler)  # not wrapped: set_epoch reaches it


def test_the_data_module_shards_for_its_trainer(text_corpus):
    from lit_losses import TextDataModule

    data = TextDataModule(
        paths=[str(text_corpus / "*.txt")],
        vocab_size=300,
        seq_len=32,
        tokens_per_batch=64,
        max_documents=6,
        val_fraction=0.2,
    )
    data.setup("fit")
    data.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})  # a DDP trainer
    sampler = data.train_dataloader().sampler
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (2, 1, (len(data.train_set) + 1) // 2)
