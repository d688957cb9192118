"""Parameter offload: a model's block weights kept in host RAM or on NVMe and brought to the
compute device only while the block runs (:func:`offload_weights`); the model's weights saved
to and loaded from one safetensors file, a tensor at a time (:func:`save_weights`,
:func:`load_weights`)."""
from .export import LoadResult, load_weights, save_weights
from .homes import WeightsLostError
from .streamed_param import StreamedParameter
from .streamer import StreamedParam, WeightStreamer, generation, offload_weights, streamed, streamed_blocks

__all__ = ["LoadResult", "StreamedParam", "StreamedParameter", "WeightStreamer", "WeightsLostError", "generation",
           "load_weights", "offload_weights", "save_weights", "streamed", "streamed_blocks"]
