"""A character-level language model: a small decoder-only transformer and its corpus.

The second built-in recipe, and the workload the benchmarks use: unlike the
digits CNN it is made of matrix products, LayerNorms, softmax and embedding
look-ups, the operations a GPT spends its time in, and its dropout (in the
embeddings, the attention weights and every residual branch) draws from
torch's global generator on every step, so a seeding or resume mistake shows
up in the weights.

The text is the concatenation of scikit-learn's bundled dataset descriptions
(``sklearn/datasets/descr/*.rst``, sorted by file name), read with
:mod:`importlib.resources`. It ships inside an installed package whose version
the lock pins, so the corpus is the same bytes wherever the lock is installed,
with no download, no cache directory and no network. ``CharCorpus.text_sha256``
names those bytes; a different scikit-learn release may change the text, and
with it ``vocab_size`` and the splits.

At the defaults (scikit-learn 1.9.1: 43,054 characters, 92 distinct):
``TinyGPT`` has 116,060 parameters; the corpus gives 662 windows of 65
characters, split 530 / 66 / 66 (train / val / test), so an epoch at batch 32
is 17 steps (the last one of 18 windows). One training epoch took 0.9 s on
one thread of a 2-core AMD EPYC VM (n_layer=4, n_head=4, n_embd=256:
3.2 M parameters, 11.6 s), measured with::

    python -c "import torch, time, lightning as L; torch.set_num_threads(1)
    from torch.utils.data import DataLoader
    from reprotrain.recipes.language_model import CharCorpus, TinyGPT
    L.seed_everything(0); d = CharCorpus(); d.setup('fit')
    m = TinyGPT(d.vocab_size, d.block_size)
    t = L.Trainer(accelerator='cpu', max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=0, deterministic=True)
    loader = DataLoader(d.train_dataset(), batch_size=32, shuffle=True)
    s = time.perf_counter(); t.fit(m, loader); print(time.perf_counter() - s)"

Attention is written out (``q @ k^T`` scaled, a causal ``masked_fill`` with
``-inf``, softmax, dropout, ``@ v``) rather than calling
``F.scaled_dot_product_attention``, whose kernel (flash, memory-efficient,
cuDNN or math) torch picks by device, dtype and shape: written out, CPU and GPU
run the same sequence of operations, none of which is on torch's list of
nondeterministic CUDA operations, so the model trains under
``torch.use_deterministic_algorithms(True)`` (checked against torch 2.13's
list and on CPU; not yet run on a GPU). The loss flattens
the logits to ``(batch x time, vocab)`` for the same reason: cross-entropy on
``(batch, vocab, time)`` takes CUDA's ``nll_loss2d``, which that setting refuses.
"""

from __future__ import annotations

import hashlib
import math
from importlib import resources

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

CORPUS_PACKAGE = "sklearn.datasets"
CORPUS_FOLDER = "descr"


def corpus_text() -> str:
    """scikit-learn's dataset descriptions, concatenated in file-name order."""
    folder = resources.files(CORPUS_PACKAGE) / CORPUS_FOLDER
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".rst"))
    if not names:
        raise FileNotFoundError(
            f"no .rst files under {CORPUS_PACKAGE}/{CORPUS_FOLDER}; "
            "install the scikit-learn version the lock pins"
        )
    return "".join((folder / name).read_text(encoding="utf-8") for name in names)


class CharCorpus(L.LightningDataModule):
    """Non-overlapping windows of the corpus, as (input, next-character target) pairs.

    Windows are cut in text order and split contiguously (train first, then
    val, then test), so the splits share no characters and depend on nothing
    but the text and the arguments. The pipeline builds the loaders.
    """

    model_links: tuple[str, ...] = ("vocab_size", "block_size")

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be 0 or more, got {num_workers}")
        for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0 < fraction < 1:
                raise ValueError(f"{name} must be between 0 and 1 (exclusive), got {fraction}")
        if val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction + test_fraction must be below 1 to leave windows to train on, "
                f"got {val_fraction} + {test_fraction}"
            )
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.vocab: list[str] = []
        self.vocab_size = 0
        self.text_sha256 = ""
        self._splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        """Build all three splits (whatever the stage: they are small and cheap)."""
        if self._splits:
            return
        text = corpus_text()
        self.text_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self.vocab = sorted(set(text))
        self.vocab_size = len(self.vocab)
        index = {char: i for i, char in enumerate(self.vocab)}
        tokens = torch.tensor([index[char] for char in text], dtype=torch.int64)
        span = self.block_size + 1
        count = len(tokens) // span
        n_val = int(count * self.val_fraction)
        n_test = int(count * self.test_fraction)
        n_train = count - n_val - n_test
        if min(n_train, n_val, n_test) < 1:
            raise ValueError(
                f"the corpus ({len(tokens)} characters) gives {count} windows of block_size+1 "
                f"= {span}: {n_train} train, {n_val} val, {n_test} test; every split needs one. "
                "Lower block_size or raise the fractions"
            )
        windows = tokens[: count * span].view(count, span)
        bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val)}
        bounds["test"] = (n_train + n_val, count)
        self._splits = {
            name: TensorDataset(windows[start:stop, :-1], windows[start:stop, 1:])
            for name, (start, stop) in bounds.items()
        }

    def train_dataset(self) -> Dataset:
        return self._split("train")

    def val_dataset(self) -> Dataset:
        return self._split("val")

    def test_dataset(self) -> Dataset:
        return self._split("test")

    def _split(self, name: str) -> TensorDataset:
        if not self._splits:
            raise RuntimeError(f"CharCorpus.{name}_dataset() before setup(); call setup() first")
        return self._splits[name]


ATTENTION = ("manual", "sdpa")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and the positions before it.

    ``attention="manual"`` writes it out (the module docstring says why); ``"sdpa"`` calls
    ``F.scaled_dot_product_attention`` with ``is_causal``, as most users' models do.
    """

    def __init__(
        self, n_embd: int, n_head: int, block_size: int, dropout: float, attention: str = "manual"
    ) -> None:
        super().__init__()
        self.n_head = n_head
        self.attention = attention
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # Not persistent: derived from block_size, so state_dict holds only what training learns.
        mask = torch.ones(block_size, block_size, dtype=torch.bool).tril()
        self.register_buffer("causal", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (batch, head, time, head_size)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            p = self.dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            out = out.transpose(1, 2).contiguous().view(batch, time, channels)
            return self.resid_dropout(self.proj(out))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal: torch.Tensor = self.causal  # type: ignore[assignment]
        scores = scores.masked_fill(~causal[:, :, :time, :time], float("-inf"))
        weights = self.attn_dropout(F.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(out))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention, then a 4x GELU MLP, each on a residual."""

    def __init__(
        self, n_embd: int, n_head: int, block_size: int, dropout: float, attention: str = "manual"
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout, attention)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(L.LightningModule):
    """Decoder-only transformer predicting the next character; logs ``val_loss``, ``test_*``.

    ``compile=True`` compiles each block with ``torch.compile`` in ``configure_model``, as
    Lightning's docs show (``Module.compile``: in place, so the state dict's keys stay those
    of the uncompiled model and one checkpoint loads into either).
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        dropout: float = 0.1,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        attention: str = "manual",
        compile: bool = False,
    ) -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if n_layer < 1 or n_head < 1:
            raise ValueError(f"n_layer and n_head must be at least 1, got {n_layer}, {n_head}")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.block_size = block_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.compile_blocks = compile
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(Block(n_embd, n_head, block_size, dropout, attention) for _ in range(n_layer))
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def configure_model(self) -> None:
        if self.compile_blocks:
            for block in self.blocks:
                block.compile()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab)`` for token ids ``(batch, time)``."""
        time = tokens.size(1)
        if time > self.block_size:
            raise ValueError(f"a {time}-token sequence is longer than block_size {self.block_size}")
        positions = self.position_embedding(torch.arange(time, device=tokens.device))
        x = self.embedding_dropout(self.token_embedding(tokens) + positions)
        return self.head(self.ln_f(self.blocks(x)))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over every position of every window."""
        x, y = batch
        logits = self(x)
        # Flattened: (batch, vocab, time) would take CUDA's nll_loss2d, not deterministic.
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        return self.loss(batch)  # the pipeline logs train_loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        self.log("val_loss", self.loss(batch), on_epoch=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        loss = self.loss(batch)
        self.log("test_loss", loss, on_epoch=True)
        self.log("test_bits_per_char", loss / math.log(2), on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
