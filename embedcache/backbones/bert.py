"""A small pure-torch BERT encoder as StagedNet stages (docs/contracts.md section 3d).

BERT (Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding", NAACL 2019, Sec. 3) as sentence-transformers runs it for all-MiniLM-L6-v2
(Reimers & Gurevych, "Sentence-BERT", EMNLP 2019, Sec. 3: mean pooling over the tokens), without
importing transformers: the embeddings, L post-norm encoder layers and the pooling are the stages
``embeddings``, ``layer.0`` .. ``layer.{L-1}``, ``pool``, so that a text encoder can be cut, cached and
fine-tuned like the image backbones.

Every stage is called as ``module(x, mask)``: the attention mask is never optional. Without it the
padded positions of a batch take part in attention and in the mean (the tokenizer pads): two
unrelated sentences in one padded batch then score cosine 0.77 instead of 0.15.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from embedcache.backbones.staged import StagedNet
from embedcache.errors import UserError
from embedcache.parsing import loads_json


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT config.json this forward implements."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_json(cls, path: Path, *, who: str) -> BertConfig:
        """Read and check config.json: only what this module implements is accepted."""
        try:
            raw = loads_json(Path(path).read_text(), f"{who}: {path}")
        except (OSError, ValueError) as exc:
            raise UserError(f"{who}: cannot read {path} ({exc})") from None
        unsupported = {"hidden_act": "gelu", "position_embedding_type": "absolute", "model_type": "bert"}
        for key, want in unsupported.items():
            if raw.get(key, want) != want:
                raise UserError(f"{who}: {path}: {key} {raw.get(key)!r} is not supported (only {want!r})")
        try:
            cfg = cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})
        except TypeError as exc:
            raise UserError(f"{who}: {path}: missing fields ({exc})") from None
        if cfg.hidden_size % cfg.num_attention_heads:
            raise UserError(f"{who}: {path}: hidden_size {cfg.hidden_size} is not a multiple of the heads")
        return cfg


class Embeddings(nn.Module):
    """Word + token type 0 + absolute position embeddings, LayerNorm, dropout (HF BertEmbeddings)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # single sentences: token type 0 everywhere; the additions in HF's order (same rounding)
        x = self.word_embeddings(ids) + self.token_type_embeddings.weight[0]
        x = x + self.position_embeddings.weight[: ids.shape[1]]
        return self.dropout(self.LayerNorm(x))


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.p = cfg.attention_probs_dropout_prob

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        # the key padding mask as HF's additive bias (finfo.min, not -inf: a row without any valid
        # key stays finite), in the activations' dtype so that autocast runs it too
        bias = (~mask).to(q.dtype)[:, None, None, :] * torch.finfo(q.dtype).min
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.p if self.training else 0.0,
                                             scale=1.0 / math.sqrt(q.shape[-1]))
        b, h, t, dh = out.shape
        return out.transpose(1, 2).reshape(b, t, h * dh)


class _AddNorm(nn.Module):
    """dense -> dropout -> + residual -> LayerNorm (HF BertSelfOutput / BertOutput)."""

    def __init__(self, d_in: int, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class _Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _AddNorm(cfg.hidden_size, cfg)


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class Layer(nn.Module):
    """One post-norm BERT encoder layer; the children carry HF's names, so weights load by name."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _AddNorm(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, mask), x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)  # exact (erf) GELU: config "gelu"


class MeanPoolL2(nn.Module):
    """Masked mean over the tokens, then L2 normalisation: sentence-transformers' Pooling
    (mean tokens) and Normalize modules."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(x.dtype)
        mean = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
        return F.normalize(mean, p=2.0, dim=1)


class TextStagedNet(StagedNet):
    """A text encoder as stages; ``forward(x, start, stop, *, mask)`` (contract 3d)."""

    modality = "text"

    def forward(self, x: torch.Tensor, start: str | None = None, stop: str | None = None, *,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            raise UserError(f"{self.name}: forward() needs mask= (the [B, T] attention mask that tokenize() "
                            "returns); without it padded positions change the output")
        first = 0 if start is None else self._index(start, "cut point") + 1
        last = len(self.stage_names) - 1 if stop is None else self._index(stop, "stage")
        if last < first:
            raise UserError(f"{self.name}: stop {stop!r} does not come after start {start!r} "
                            f"(stages: {', '.join(self.stage_names)})")
        if start is None:
            if x.ndim != 2 or x.dtype.is_floating_point:
                raise UserError(f"{self.name}: input ids must be a [B, T] integer tensor, got "
                                f"{x.dtype} {list(x.shape)}")
        else:
            x = self._as_tokens(x, start)
        if tuple(mask.shape) != tuple(x.shape[:2]):
            raise UserError(f"{self.name}: mask {list(mask.shape)} does not match the tokens {list(x.shape[:2])}")
        mask = mask if mask.dtype == torch.bool else mask != 0
        for key in self._keys[first:last + 1]:
            x = self._modules[key](x, mask)
        return x

    def _as_tokens(self, x: torch.Tensor, start: str) -> torch.Tensor:
        t_max, d = self._shapes[start]
        if x.ndim == 3 and x.shape[2] == d and x.shape[1] <= t_max:
            return x
        if x.ndim == 2 and x.shape[1] == t_max * d:  # rows as the store holds them (T-major)
            return x.reshape(x.shape[0], t_max, d)
        raise UserError(f"{self.name}: input after {start!r} must be [B, t <= {t_max}, {d}] or [B, {t_max * d}], "
                        f"got {list(x.shape)}")


def build_bert(name: str, cfg: BertConfig, max_length: int) -> TextStagedNet:
    """An untrained BERT as a TextStagedNet (load weights with :func:`bert_state_dict`)."""
    stages: list[tuple[str, nn.Module]] = [("embeddings", Embeddings(cfg))]
    stages += [(f"layer.{i}", Layer(cfg)) for i in range(cfg.num_hidden_layers)]
    stages.append(("pool", MeanPoolL2()))
    d = cfg.hidden_size
    net = TextStagedNet(name, stages, input_size=(max_length,), shapes=[(max_length, d)] * (len(stages) - 1) + [(d,)])
    return net.eval()


def bert_state_dict(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF BertModel keys -> TextStagedNet keys (``encoder.layer.3.`` -> ``layer_3.``, an optional
    ``bert.`` prefix dropped); returns (mapped, dropped keys): the CLS pooler and the position-id
    buffer play no part in mean pooling."""
    out, dropped = {}, []
    for key, value in state.items():
        k = key[len("bert."):] if key.startswith("bert.") else key
        if k.startswith(("pooler.", "embeddings.position_ids")):
            dropped.append(key)
            continue
        if k.startswith("encoder.layer."):
            i, rest = k[len("encoder.layer."):].split(".", 1)
            k = f"layer_{i}.{rest}"
        out[k] = value
    return out, dropped
