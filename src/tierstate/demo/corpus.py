"""A synthetic text corpus with learnable structure and a known loss floor.

[Note: what the corpus is]
The text is a sequence of "words" separated by spaces. A word is one of ``vocabulary_size``
distinct strings of lowercase letters (``min_word_len``..``max_word_len`` long), each spelled
by a walk on a sparse letter chain in which every letter has only 3 possible successors.
Which word comes next is a first-order Markov chain over words: each word has ``branching``
possible successors with Dirichlet-drawn probabilities. A model has four things to learn, in
the order the loss shows them falling (figures for seed 0, defaults, in nats per byte):
  1. which bytes occur at all (27 of 256): 5.55 (uniform) -> 3.0 (letter frequencies);
  2. which letter may follow which: -> 1.45 (the bigram entropy), within tens of steps;
  3. how each word is spelled: once its first letters are seen, the rest of a word and
     the space after it are certain;
  4. which words may follow which: the only uncertainty left, at word boundaries.
The tiny preset goes from ~5.2 to ~1.9 in 100 steps (batch 16 x 64 bytes).

[Note: the loss floor]
Spaces end words and never occur inside one, so the byte stream and the word sequence
determine each other. The entropy rate per byte is therefore the word chain's entropy rate
divided by the mean bytes per word (letters plus the space), both under the chain's stationary
distribution:
    H_byte = sum_i pi_i * H(P[i, :]) / sum_i pi_i * (len(word_i) + 1)      (nats per byte)
:attr:`SyntheticCorpus.entropy_per_token` computes it exactly. No model can have a lower mean
cross-entropy on this corpus; with the defaults it is 0.15-0.17 nats/byte (seed-dependent),
against 5.55 for a uniform guess, so the whole fall of the demo's loss is visible. A model
reaching it needs only one word of context, so even the tiny preset can approach it; the
first bytes of each training window lack that context, so a run sits slightly above it.
"""
from __future__ import annotations

import bisect
import math
import string

import numpy as np
import torch

_LETTERS = string.ascii_lowercase.encode()
# Letters that may follow a letter inside a word (see _draw_words).
_LETTER_BRANCHING = 3


class SyntheticCorpus:
    """Deterministic byte text from a word-level Markov chain (see the module notes).

    The same arguments always give the same text; nothing is downloaded.

    Args:
        seed: selects the words, the chain and the text.
        vocabulary_size: number of distinct words.
        branching: successors per word (the chain's out-degree).
        min_word_len, max_word_len: word lengths in letters, inclusive.
        length: bytes of text generated up front; training windows are cut from it.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        vocabulary_size: int = 64,
        branching: int = 4,
        min_word_len: int = 3,
        max_word_len: int = 8,
        length: int = 1 << 20,
    ) -> None:
        for name, value, low in (
            ("vocabulary_size", vocabulary_size, 2),
            ("branching", branching, 1),
            ("min_word_len", min_word_len, 1),
            ("length", length, 2),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SyntheticCorpus({name}={value!r}): must be an int >= {low}")
        if not isinstance(max_word_len, int) or max_word_len < min_word_len:
            raise ValueError(
                f"SyntheticCorpus(max_word_len={max_word_len!r}): must be an int >= "
                f"min_word_len={min_word_len}"
            )
        if branching > vocabulary_size:
            raise ValueError(
                f"SyntheticCorpus(branching={branching}): a word can have at most "
                f"vocabulary_size={vocabulary_size} successors"
            )
        distinct_words = sum(26 * _LETTER_BRANCHING ** (n - 1) for n in range(min_word_len, max_word_len + 1))
        if vocabulary_size > distinct_words:
            raise ValueError(
                f"SyntheticCorpus(vocabulary_size={vocabulary_size}): only {distinct_words} distinct "
                f"words of {min_word_len}..{max_word_len} letters exist; raise max_word_len"
            )
        self.seed = seed
        rng = np.random.default_rng(seed)
        self.words = _draw_words(rng, vocabulary_size, min_word_len, max_word_len)
        self.successors, self.transition = _draw_chain(rng, vocabulary_size, branching)
        self.tokens = _generate(rng, self.words, self.successors, self.transition, length)

    @property
    def vocab_size(self) -> int:
        """Token ids lie in ``[0, vocab_size)``: the corpus is bytes."""
        return 256

    @property
    def entropy_per_token(self) -> float:
        """The entropy rate of the text in nats per byte: the lowest achievable mean loss."""
        k = len(self.words)
        dense = np.zeros((k, k))
        np.put_along_axis(dense, self.successors, self.transition, axis=1)
        stationary = _stationary_distribution(dense)
        row_entropy = -(self.transition * np.log(self.transition)).sum(axis=1)
        bytes_per_word = np.array([len(w) + 1 for w in self.words], dtype=np.float64)
        return float(stationary @ row_entropy / (stationary @ bytes_per_word))

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of ``seq_len + 1`` bytes, split into inputs and targets.

        Returns ``(inputs, targets)``, both int64 of shape (batch_size, seq_len), with
        ``targets[:, t] == inputs[:, t + 1]`` where both exist (next-token prediction).
        """
        if seq_len < 1 or seq_len + 1 > len(self.tokens):
            raise ValueError(
                f"seq_len={seq_len}: must be in [1, {len(self.tokens) - 1}] for a corpus of "
                f"{len(self.tokens)} bytes"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        starts = torch.randint(0, len(self.tokens) - seq_len, (batch_size,), generator=generator)
        windows = self.tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]

    def text(self, start: int = 0, length: int = 200) -> str:
        """A slice of the corpus as a string, to show what the model is learning."""
        return bytes(self.tokens[start : start + length].tolist()).decode("ascii")


def _draw_words(rng: np.random.Generator, count: int, min_len: int, max_len: int) -> list[bytes]:
    """``count`` distinct words, each spelled by a walk on a sparse letter chain.

    Every letter may be followed by only ``_LETTER_BRANCHING`` of the 26 letters, so the
    previous letter alone predicts the next one well: a model learns this bigram
    structure within tens of steps, long before it has memorised whole words.
    """
    next_letters = np.stack([rng.choice(26, size=_LETTER_BRANCHING, replace=False) for _ in range(26)])
    words: list[bytes] = []
    seen: set[bytes] = set()
    while len(words) < count:
        length = int(rng.integers(min_len, max_len + 1))
        letters = [int(rng.integers(26))]
        for choice in rng.integers(0, _LETTER_BRANCHING, size=length - 1):
            letters.append(int(next_letters[letters[-1], choice]))
        word = bytes(_LETTERS[i] for i in letters)
        if word not in seen:  # distinct words keep the byte stream uniquely decodable
            seen.add(word)
            words.append(word)
    return words


def _draw_chain(rng: np.random.Generator, count: int, branching: int) -> tuple[np.ndarray, np.ndarray]:
    """Successor ids (count, branching) and their probabilities (count, branching)."""
    successors = np.empty((count, branching), dtype=np.int64)
    for i in range(count):
        # Word i+1 is always a successor: the chain then holds one cycle through every word,
        # so it is irreducible and its stationary distribution is unique.
        others = rng.choice(np.delete(np.arange(count), (i + 1) % count), size=branching - 1, replace=False)
        successors[i] = np.concatenate(([(i + 1) % count], others))
    # Dirichlet(1) rows: some transitions near-certain, some near-uniform, so the chain has
    # both easy and hard word boundaries.
    transition = rng.dirichlet(np.ones(branching), size=count)
    transition = np.maximum(transition, 1e-6)  # log(0) would poison the entropy
    transition /= transition.sum(axis=1, keepdims=True)
    return successors, transition


def _generate(
    rng: np.random.Generator,
    words: list[bytes],
    successors: np.ndarray,
    transition: np.ndarray,
    length: int,
) -> torch.Tensor:
    cumulative = [list(np.cumsum(row)) for row in transition]
    successor_lists = successors.tolist()
    mean_bytes = sum(len(w) + 1 for w in words) / len(words)
    # Uniforms drawn in chunks: a Python loop over bisect is ~0.3 us per word (~0.1 s per
    # MiB of text); numpy's per-call overhead would be several times that.
    chunk = int(length / mean_bytes * 1.2) + 16
    pieces: list[bytes] = []
    produced = 0
    word = int(rng.integers(len(words)))
    while produced < length:
        for u in rng.random(chunk).tolist():
            choice = min(bisect.bisect_right(cumulative[word], u), len(cumulative[word]) - 1)
            word = successor_lists[word][choice]
            pieces.append(words[word])
            pieces.append(b" ")
            produced += len(words[word]) + 1
            if produced >= length:
                break
    data = b"".join(pieces)[:length]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _stationary_distribution(transition: np.ndarray) -> np.ndarray:
    """pi with pi @ P = pi, sum(pi) = 1, for an irreducible chain (periodic or not)."""
    k = transition.shape[0]
    # Solve (P^T - I) pi = 0 together with 1^T pi = 1 as one least-squares system.
    system = np.vstack([transition.T - np.eye(k), np.ones((1, k))])
    rhs = np.zeros(k + 1)
    rhs[-1] = 1.0
    stationary, *_ = np.linalg.lstsq(system, rhs, rcond=None)
    return np.clip(stationary, 0.0, None) / np.clip(stationary, 0.0, None).sum()


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy of a model that guesses uniformly over ``vocab_size`` tokens: ln(V)."""
    return math.log(vocab_size)
