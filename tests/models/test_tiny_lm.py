import torch

from lit_losses.models.tiny_lm import TinyTransformer


def test_packed_documents_do_not_see_each_other():
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=100, d_model=32, n_layers=2, n_heads=4).eval()
    doc1 = torch.randint(0, 100, (7,))
    doc2 = torch.randint(0, 100, (9,))
    seg = torch.tensor([[1] * 7 + [2] * 9])
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    h = model(torch.cat([doc1, doc2])[None], seg, pos)
    other1 = torch.randint(0, 100, (7,))
    h_other = model(torch.cat([other1, doc2])[None], seg, pos)
    assert not torch.allclose(h[0, :7], h_other[0, :7])
    torch.testing.assert_close(h[0, 7:], h_other[0, 7:], rtol=0, atol=1e-6)
    # and document 2 packed equals document 2 alone
    alone = model(doc2[None])
    torch.testing.assert_close(h[0, 7:], alone[0], rtol=1e-5, atol=1e-5)


def test_a_longer_first_document_does_not_change_the_second():
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=50, d_model=32, n_layers=2, n_heads=2).eval()
    doc2 = torch.randint(0, 50, (5,))
    outs = []
    for n1 in (3, 11):
        ids = torch.cat([torch.randint(0, 50, (n1,)), doc2])[None]
        seg = torch.tensor([[1] * n1 + [2] * 5])
        pos = torch.cat([torch.arange(n1), torch.arange(5)])[None]
        outs.append(model(ids, seg, pos)[0, n1:])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_without_segments_attention_is_causal():
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=50, d_model=32, n_layers=2, n_heads=2).eval()
    ids = torch.randint(0, 50, (1, 10))
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 50
    torch.testing.assert_close(model(ids)[0, :6], model(changed)[0, :6], rtol=0, atol=1e-6)
