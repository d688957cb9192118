"""Choosing the next token exactly as transformers' ``generate`` does.

Greedy is ``argmax`` of the float32 logits. Sampling runs transformers' own warpers in its
order (temperature, top-k, top-p), a softmax, and one ``torch.multinomial`` over the whole
batch per step, rows that already stopped included (their token is then replaced by the pad
token), so the random stream is consumed as in ``generate``.

[Note: what "the same seed" means]
``seed=s`` draws from ``torch.Generator().manual_seed(s)``, a generator of our own, which is
the state torch's global CPU generator has right after ``torch.manual_seed(s)``. So
``OffloadedLM.generate(..., do_sample=True, seed=s)`` gives the tokens of
``torch.manual_seed(s); model.generate(..., do_sample=True)`` with the same temperature,
top_k and top_p, and leaves the global generator alone.
"""
from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_TOP_K = 50  # transformers' GenerationConfig default when sampling


class Sampler:
    def __init__(self, do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None,
                 seed: int | None) -> None:
        if not isinstance(do_sample, bool):
            raise TypeError(f"do_sample={do_sample!r}: expected True or False")
        self.do_sample = do_sample
        self.processors = []
        self.generator = None
        if not do_sample:
            return
        temperature = 1.0 if temperature is None else temperature
        top_k = DEFAULT_TOP_K if top_k is None else top_k
        top_p = 1.0 if top_p is None else top_p
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature={temperature!r}: expected a number > 0 (1.0 keeps the logits as they are)")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k={top_k!r}: expected an int >= 0 (0 keeps every token)")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p!r}: expected a number in (0, 1] (1.0 keeps every token)")
        from transformers.generation.logits_process import (  # noqa: PLC0415
            TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

        if temperature != 1.0:
            self.processors.append(TemperatureLogitsWarper(float(temperature)))
        if top_k != 0:
            self.processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p < 1.0:
            self.processors.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
                raise ValueError(f"seed={seed!r}: expected an int >= 0, or None to draw from torch's global generator")
            self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, input_ids: Tensor, logits: Tensor) -> Tensor:
        if not self.do_sample:
            return torch.argmax(logits, dim=-1)
        scores = logits
        for p in self.processors:
            scores = p(input_ids, scores)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
