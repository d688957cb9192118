"""The synthetic corpus: deterministic per seed, bytes in range, and its stated entropy true."""
import collections
import math

import pytest
import torch

from tierstate.demo.corpus import SyntheticCorpus

SMALL = dict(length=1 << 16)  # 64 KiB of text: enough for every property below, ~10 ms


def test_same_seed_same_text_and_other_seed_other_text():
    a, b, c = SyntheticCorpus(7, **SMALL), SyntheticCorpus(7, **SMALL), SyntheticCorpus(8, **SMALL)
    assert torch.equal(a.tokens, b.tokens)
    assert a.words == b.words
    assert not torch.equal(a.tokens, c.tokens)
    assert a.entropy_per_token != c.entropy_per_token


def test_batches_are_deterministic_per_generator_and_shifted_by_one():
    corpus = SyntheticCorpus(0, **SMALL)
    x1, y1 = corpus.batch(4, 32, torch.Generator().manual_seed(3))
    x2, y2 = corpus.batch(4, 32, torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (4, 32) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # next-token targets


def test_tokens_are_lowercase_words_and_spaces_within_the_byte_vocabulary():
    corpus = SyntheticCorpus(1, **SMALL)
    assert corpus.tokens.dtype == torch.uint8 and len(corpus.tokens) == SMALL["length"]
    allowed = set(b"abcdefghijklmnopqrstuvwxyz ")
    assert set(corpus.tokens.tolist()) <= allowed
    assert int(corpus.tokens.max()) < corpus.vocab_size == 256
    assert len(set(corpus.words)) == len(corpus.words) == 64
    assert all(3 <= len(w) <= 8 and b" " not in w for w in corpus.words)
    # Every complete word in the text is one of the corpus's words.
    assert set(corpus.text(0, SMALL["length"]).split(" ")[1:-1]) <= {w.decode() for w in corpus.words}


def test_entropy_per_token_matches_the_text():
    corpus = SyntheticCorpus(2)  # 1 MiB: ~180k words, so the plug-in estimate is within ~1%
    words = corpus.text(0, len(corpus.tokens)).split(" ")[1:-1]
    pairs = collections.Counter(zip(words, words[1:]))
    firsts = collections.Counter(words[:-1])
    nats_per_word = -sum(n * math.log(n / firsts[a]) for (a, _), n in pairs.items()) / (len(words) - 1)
    bytes_per_word = sum(len(w) + 1 for w in words) / len(words)
    assert corpus.entropy_per_token == pytest.approx(nats_per_word / bytes_per_word, rel=0.03)
    assert 0.05 < corpus.entropy_per_token < 0.5  # the figure the module notes promise


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(vocabulary_size=1), "vocabulary_size"),
        (dict(branching=0), "branching"),
        (dict(branching=100), "branching"),
        (dict(min_word_len=5, max_word_len=4), "max_word_len"),
        (dict(vocabulary_size=100, min_word_len=1, max_word_len=1), "vocabulary_size"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        SyntheticCorpus(0, **kwargs)


def test_batch_rejects_windows_longer_than_the_text():
    corpus = SyntheticCorpus(0, length=100)
    with pytest.raises(ValueError, match="seq_len=100"):
        corpus.batch(1, 100, torch.Generator())
