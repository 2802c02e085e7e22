"""The language-model recipe: a pinned corpus, exact windows and splits, bitwise reruns."""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import warnings
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from reprotrain.recipes.language_model import CharCorpus, TinyGPT, corpus_text

# scikit-learn 1.9.1's descriptions; the module docstring's sizes were measured on this text.
CORPUS_SHA256 = "efcc63d1a838d2134e9078ff3e2d7c6b66098f891425d381cef4879fe3ca390f"
SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 16}


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _corpus(**kwargs: float) -> CharCorpus:
    corpus = CharCorpus(**kwargs)  # type: ignore[arg-type]
    corpus.setup("fit")
    return corpus


def test_the_corpus_is_the_same_text_every_time() -> None:
    first, second = _corpus(), _corpus()
    assert first.text_sha256 == second.text_sha256
    assert hashlib.sha256(corpus_text().encode("utf-8")).hexdigest() == first.text_sha256
    assert (first.vocab_size, first.vocab) == (second.vocab_size, second.vocab)
    assert first.vocab == sorted(set(corpus_text()))


def test_the_corpus_is_the_one_the_docstring_measured() -> None:
    assert _corpus().text_sha256 == CORPUS_SHA256, (
        "scikit-learn's dataset descriptions changed (a new release in the lock?): "
        "measure again, update the sizes in language_model's docstring and CORPUS_SHA256"
    )


def test_windows_are_block_size_long_and_y_is_x_shifted_by_one() -> None:
    corpus = _corpus(block_size=16)
    for split in (corpus.train_dataset(), corpus.val_dataset(), corpus.test_dataset()):
        x, y = split[0]
        assert x.shape == y.shape == (16,)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])


def test_splits_tile_the_text_in_order_and_follow_the_fractions() -> None:
    corpus = _corpus(block_size=32, val_fraction=0.2, test_fraction=0.05)
    text = corpus_text()
    count = len(text) // 33
    splits = [corpus.train_dataset(), corpus.val_dataset(), corpus.test_dataset()]
    assert [len(s) for s in splits] == [
        count - int(count * 0.2) - int(count * 0.05),
        int(count * 0.2),
        int(count * 0.05),
    ]
    # Train, then val, then test, each window once: together they are the text's prefix.
    windows = [torch.cat([x, y[-1:]]) for split in splits for x, y in split]
    decoded = "".join(corpus.vocab[i] for i in torch.cat(windows).tolist())
    assert decoded == text[: count * 33]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"test_fraction": 1.5}, "test_fraction"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "val_fraction \\+ test_fraction"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_a_bad_argument_is_refused_by_name(kwargs: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        CharCorpus(**kwargs)  # type: ignore[arg-type]


def test_a_block_too_long_for_every_split_is_refused() -> None:
    with pytest.raises(ValueError, match="every split needs one"):
        _corpus(block_size=len(corpus_text()) // 5)


def test_the_data_module_leaves_the_loaders_to_the_pipeline() -> None:
    for loader in ("train_dataloader", "val_dataloader", "test_dataloader"):
        assert getattr(CharCorpus, loader) is getattr(L.LightningDataModule, loader)


def test_model_links_name_set_attributes_and_model_arguments() -> None:
    corpus = _corpus(block_size=8)
    parameters = inspect.signature(TinyGPT).parameters
    for name in CharCorpus.model_links:
        assert name in parameters
        assert isinstance(getattr(corpus, name), int)
    assert corpus.vocab_size == len(corpus.vocab) > 1


def _trainer(**kwargs: object) -> L.Trainer:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    return L.Trainer(
        accelerator="cpu", deterministic=True, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def _fit(seed: int) -> tuple[TinyGPT, CharCorpus]:
    L.seed_everything(seed, verbose=False)
    corpus = _corpus(block_size=16, batch_size=16)
    model = TinyGPT(corpus.vocab_size, corpus.block_size, **SMALL)  # type: ignore[arg-type]
    loader = DataLoader(
        corpus.train_dataset(),
        batch_size=corpus.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and validation
        trainer = _trainer(max_steps=20, limit_val_batches=0)
        trainer.fit(model, loader)
    assert trainer.global_step == 20
    return model, corpus


@pytest.mark.usefixtures("restore_torch_flags", "one_thread")
def test_same_seed_gives_identical_weights_and_another_seed_does_not() -> None:
    first, second, other = (_fit(seed)[0].state_dict() for seed in (0, 0, 1))
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)  # negative control


@pytest.mark.usefixtures("restore_torch_flags", "one_thread")
def test_test_step_logs_loss_and_bits_per_char() -> None:
    model, corpus = _fit(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = _trainer().test(model, DataLoader(corpus.test_dataset(), batch_size=16))
    assert set(metrics) == {"test_loss", "test_bits_per_char"}
    assert 0 < metrics["test_loss"] < math.log(corpus.vocab_size) + 1
    assert metrics["test_bits_per_char"] == pytest.approx(metrics["test_loss"] / math.log(2))


def test_the_model_refuses_a_sequence_longer_than_its_block() -> None:
    model = TinyGPT(vocab_size=5, block_size=4, **SMALL)  # type: ignore[arg-type]
    assert model(torch.zeros(2, 4, dtype=torch.int64)).shape == (2, 4, 5)
    with pytest.raises(ValueError, match="block_size 4"):
        model(torch.zeros(2, 5, dtype=torch.int64))


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=7, block_size=8, dropout=0.0, **SMALL).eval()  # type: ignore[arg-type]
    tokens = torch.randint(0, 7, (1, 8))
    changed = tokens.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 7
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[0, :5], after[0, :5])  # earlier positions never see later ones
    assert not torch.equal(before[0, 5:], after[0, 5:])
