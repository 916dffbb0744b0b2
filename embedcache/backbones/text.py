"""Text backbones (docs/contracts.md section 3d): a frozen text encoder behind the Backbone
contract, ``modality = "text"``. Texts are tokenized with the Hugging Face ``tokenizers`` package
(Rust) from a tokenizer.json and encoded by a :class:`TextStagedNet` (embed and trainable() run the
same stages, so a fine-tuned copy starts exactly where the cache is).

``<name>@<cut>`` gives the token states after a stage, padded to T and flattened T-major, for the
token shards of FedDRA's stage 1 (store contract 4): the alignment modules are transformers over
the tokens, so they need the states before pooling, with the mask.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from embedcache.backbones.base import Backbone, check_device, cuda_autocast
from embedcache.backbones.bert import TextStagedNet
from embedcache.backbones.preprocessing import Preprocessing
from embedcache.errors import UserError

TokenBatch = tuple[torch.Tensor, torch.Tensor]


def load_tokenizer(path: Path, max_length: int, *, who: str) -> Any:
    """A ``tokenizers.Tokenizer`` from tokenizer.json that truncates to ``max_length`` and pads to
    the longest text of a batch (the file's own padding/truncation settings are replaced)."""
    # Tokenizing is microseconds per text: Rust threads would only compete with torch for the
    # cores and warn after every fork (DataLoader workers, dask).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exceptions
        raise UserError(f"{who}: cannot read the tokenizer {path} ({exc})") from None
    pad_id = tok.token_to_id("[PAD]")
    if pad_id is None:
        raise UserError(f"{who}: {path} has no [PAD] token")
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=pad_id, pad_token="[PAD]")
    return tok


class TextBackbone(Backbone):
    """A frozen text encoder: pooled embedding (``embed``) or, as ``B@CUT``, token states."""

    modality = "text"

    def __init__(self, name: str, net: TextStagedNet, tokenizer: Any, *, weights_sha256: str,
                 preprocess: Preprocessing | Mapping[str, Any],
                 device: str = "cpu", cut: str | None = None, registry_base: str | None = None,
                 note: str = "") -> None:
        self.name = name
        # the registry name of the architecture: a `ckpt:` text encoder's base (what a re-export names)
        self.registry_base = registry_base or name.rsplit("@", 1)[0]
        self.note = note
        self.weights_sha256 = weights_sha256
        self.preprocess = preprocess
        self.cut = cut
        self.max_length = int(net.input_size[0])
        self.token_dim = int(net.stage_output_shape(net.cut_points()[-1])[1])
        self.token_shape: tuple[int, int] | None = None if cut is None else (self.max_length, self.token_dim)
        self._net = net.eval().requires_grad_(False)
        self._tok = tokenizer
        self._tok_full: Any = None
        self._device = torch.device("cpu")
        self.to(device)
        ids, mask = self.tokenize(["a"])
        self.feature_dim = int(self.embed((ids, mask)).shape[1])  # measured, not trusted

    # ---------------------------------------------------------------- tokens
    def tokenize(self, texts: Sequence[str], *, pad_to_max_length: bool = False) -> TokenBatch:
        """(ids [B, t] int64, mask [B, t] bool) on the CPU; t = the longest text after truncation
        to T, or T with ``pad_to_max_length``."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise UserError(f"{self.name}: tokenize() wants a list of str")
        if not texts:
            raise UserError(f"{self.name}: tokenize() got no text")
        encs = self._tok.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in encs], dtype=torch.int64)
        mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.bool)
        if pad_to_max_length and ids.shape[1] < self.max_length:
            pad = self.max_length - ids.shape[1]
            ids = torch.nn.functional.pad(ids, (0, pad))
            mask = torch.nn.functional.pad(mask, (0, pad))
        return ids, mask

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text before truncation ([CLS] and [SEP] included): what T would need to be."""
        if self._tok_full is None:  # a second tokenizer: the first one's settings stay as they are
            from tokenizers import Tokenizer

            self._tok_full = Tokenizer.from_str(self._tok.to_str())
            self._tok_full.no_truncation()
            self._tok_full.no_padding()
        return [len(e.ids) for e in self._tok_full.encode_batch(list(texts))]

    # ---------------------------------------------------------------- inference
    def to(self, device: str) -> TextBackbone:
        dev = check_device(device, who=self.name)
        self._net.to(dev)
        self._device = dev
        return self

    def _batch(self, batch: TokenBatch | Sequence[str]) -> TokenBatch:
        if isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
            ids, mask = batch
        elif isinstance(batch, (list, tuple)) and all(isinstance(t, str) for t in batch):
            ids, mask = self.tokenize(batch)
        else:
            raise UserError(f"{self.name}: embed() wants (ids, mask) from tokenize() or a list of str, "
                            f"got {type(batch).__name__}")
        if ids.ndim != 2 or tuple(mask.shape) != tuple(ids.shape) or ids.shape[0] == 0:
            raise UserError(f"{self.name}: ids {list(ids.shape)} and mask {list(mask.shape)} must both be [B, t], B > 0")
        if ids.shape[1] > self.max_length:
            raise UserError(f"{self.name}: {ids.shape[1]} tokens > max length {self.max_length}")
        return ids, mask

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, stop: str | None) -> torch.Tensor:
        self._net.eval()
        with torch.inference_mode(), cuda_autocast(self._device):
            out = self._net(ids.to(self._device), stop=stop, mask=mask.to(self._device))
        return out.float().cpu()

    def token_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, t, D] float32: the last layer's output before pooling, 0 where mask is False."""
        ids, mask = self._batch((ids, mask))
        states = self._run(ids, mask, self._net.cut_points()[-1])
        return states * mask.unsqueeze(-1).to(states.dtype)

    def _padded_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states = self._run(ids, mask, self.cut) * mask.unsqueeze(-1).to(torch.float32)
        pad = self.max_length - states.shape[1]
        return torch.nn.functional.pad(states, (0, 0, 0, pad)).reshape(states.shape[0], -1)

    def embed(self, batch: TokenBatch | Sequence[str]) -> torch.Tensor:
        """Pooled: masked mean + L2 (sentence-transformers' encode); ``B@CUT``: the states after
        CUT padded to T, 0 where masked, flattened T-major to [B, T*D]."""
        ids, mask = self._batch(batch)
        if self.cut is None:
            return self._run(ids, mask, None)
        return self._padded_states(ids, mask)

    def embed_texts(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(embed(texts), the mask padded to T for B@CUT, else None): one extraction batch."""
        ids, mask = self.tokenize(texts)
        if self.cut is None:
            return self._run(ids, mask, None), None
        return self._padded_states(ids, mask), torch.nn.functional.pad(mask, (0, self.max_length - mask.shape[1]))

    def transform(self, img: Any, *, train: bool = False) -> torch.Tensor:
        raise UserError(f"{self.name}: a text backbone takes texts, not images (tokenize / embed)")

    # ---------------------------------------------------------------- training and cuts
    def trainable(self) -> TextStagedNet:
        """A fresh deep copy on the CPU, eval mode, every parameter trainable (contract 3a/3d)."""
        if self.cut is not None:
            raise UserError(f"{self.name}: a cut backbone only extracts token states; fine-tune {self.base_name} "
                            f"(its TextStagedNet runs from them with forward(x, start={self.cut!r}, mask=mask))")
        net = copy.deepcopy(self._net).to("cpu")
        net.requires_grad_(True)
        return net.eval()

    @property
    def base_name(self) -> str:
        return self.name.rsplit("@", 1)[0] if self.cut is not None else self.name

    def cut_backbone(self, cut: str, *, device: str | None = None) -> TextBackbone:
        """``<name>@<cut>``: the token states after ``cut``; shares this backbone's frozen weights
        on its device (another ``device`` gets a copy, so this backbone stays where it is)."""
        if self.cut is not None:
            raise UserError(f"{self.name}@{cut}: already a cut backbone")
        if cut not in self._net.cut_points():
            raise UserError(f"{self.name}@{cut}: {self.name} has no cut point {cut!r}; cut points: "
                            f"{', '.join(self._net.cut_points())}")
        shape = [self.max_length, self.token_dim]
        dev = self._device if device is None else check_device(device, who=self.name)
        net = self._net if dev == self._device else copy.deepcopy(self._net)
        return TextBackbone(f"{self.name}@{cut}", net, self._tok, weights_sha256=self.weights_sha256,
                            preprocess=self.preprocessing.with_extra(cut=cut, token_shape=shape), device=str(dev), cut=cut,
                            registry_base=self.registry_base, note=self.note)

    def __repr__(self) -> str:
        return f"TextBackbone(name={self.name!r}, feature_dim={self.feature_dim}, max_length={self.max_length})"
