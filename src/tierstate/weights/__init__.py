"""Parameter offload: a model's block weights kept in host RAM or on NVMe and brought to the
compute device only while the block runs (:func:`offload_weights`)."""
from .homes import WeightsLostError
from .streamer import StreamedParam, WeightStreamer, generation, offload_weights, streamed

__all__ = ["StreamedParam", "WeightStreamer", "WeightsLostError", "generation", "offload_weights", "streamed"]
