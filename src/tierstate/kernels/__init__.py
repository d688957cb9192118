"""Optimizer kernels for the host tier: one fused pass per parameter chunk.

The faces (``adam_update``, ``lion_update``, ``sgd_update``, ``adagrad_update``,
``grad_sumsq``, and on compressed state ``adam_q8_update``, ``quantize_blockwise``,
``dequantize_blockwise``: see ``quant.py``) take CPU tensors, validate them and run the native kernel for the
widest ISA variant this CPU supports, or the pure-torch reference in ``reference.py``
when the native module is unavailable. ``backend_info()`` says which; ``set_isa`` /
``TIERSTATE_ISA`` and ``set_num_threads`` / ``TIERSTATE_NUM_THREADS`` choose.
"""
from .backend import (
    available_isas,
    backend_info,
    current_isa,
    default_num_threads,
    drain_worker_spans,
    get_num_threads,
    q8_row_decode,
    q8_table_lookup,
    record_worker_spans,
    set_isa,
    set_num_threads,
    set_q8_row_decode,
    set_q8_table_lookup,
    use_isa,
)
from .ops import (
    adagrad_update,
    adam_q8_update,
    adam_update,
    adam_update_many,
    dequantize_blockwise,
    grad_sumsq,
    lion_update,
    quantize_blockwise,
    sgd_update,
)

__all__ = [
    "adam_update",
    "adam_update_many",
    "lion_update",
    "sgd_update",
    "adagrad_update",
    "grad_sumsq",
    "adam_q8_update",
    "quantize_blockwise",
    "dequantize_blockwise",
    "available_isas",
    "backend_info",
    "current_isa",
    "default_num_threads",
    "drain_worker_spans",
    "record_worker_spans",
    "get_num_threads",
    "q8_row_decode",
    "q8_table_lookup",
    "set_isa",
    "set_num_threads",
    "set_q8_row_decode",
    "set_q8_table_lookup",
    "use_isa",
]
