"""``tierstate demo``: a compact GPT trained on a synthetic corpus with offloaded optimizer state.

- :func:`run_demo` trains and returns a summary dict (what the command line prints).
- :class:`GPT`, :class:`GPTConfig`, :data:`MODEL_PRESETS`: the model (``model.py``).
- :class:`SyntheticCorpus`: the text, with its exact entropy floor (``corpus.py``).
"""
from .corpus import SyntheticCorpus
from .model import GPT, MODEL_PRESETS, GPTConfig
from .train import run_demo

__all__ = ["GPT", "GPTConfig", "MODEL_PRESETS", "SyntheticCorpus", "run_demo"]
