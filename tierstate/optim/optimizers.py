"""The public optimizers: torch's names and arguments, one shared offload engine.

Each class only names its rule and its arguments; everything else is
:class:`~tierstate.optim.base.OffloadOptimizer`.
"""
from __future__ import annotations

from typing import Iterable

from ..placement import Offload
from .base import OffloadOptimizer
from .rules import AdagradRule, AdamRule, LionRule, SGDRule

_ENGINE_ARGS = """
    Offload arguments (shared by every tierstate optimizer):
        offload: ``"cpu"`` (default: state in host RAM), ``"nvme"`` (state in files), ``"auto"``
            (the planner picks from the measured hardware) or a :class:`tierstate.Offload`.
            With CPU parameters and all state in RAM the optimizer also keeps host memory that
            torch frees for reuse (process-wide; ``Offload(host_allocator=...)`` and
            :mod:`tierstate.host_allocator` say why and how to opt out).
        max_grad_norm: clip the global gradient norm, computed over every tier, to this value
            (as ``torch.nn.utils.clip_grad_norm_``, which cannot see offloaded gradients).
        on_nonfinite: ``"skip"`` (default: a step with an inf/nan gradient is skipped, every state
            untouched, a warning logged and ``skipped_steps`` counted) or ``"raise"``
            (``FloatingPointError``). With a ``torch.amp.GradScaler`` the scaler decides.
        telemetry: record per-step stats (``opt.stats()``); cheap, on by default.
        step_in_backward: update each sub-group during backward as soon as every gradient in
            it is final (on CPU parameters on the backward thread itself, on accelerators on a
            worker thread), so the NVMe I/O overlaps forward and backward (default False). Exact whenever it applies; it needs every ``backward()`` to be
            followed by ``step()`` (no gradient accumulation), no ``max_grad_norm`` and no
            GradScaler, and a non-finite gradient raises instead of skipping the step. See
            :mod:`tierstate.optim.backward_update`.
"""


def _engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry, step_in_backward) -> dict:
    return dict(offload=offload, max_grad_norm=max_grad_norm, on_nonfinite=on_nonfinite, telemetry=telemetry,
                step_in_backward=step_in_backward)


class Adam(OffloadOptimizer):
    __doc__ = """Adam with offloaded state; the math of ``torch.optim.Adam`` (L2 weight decay).

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.Adam``.
""" + _ENGINE_ARGS

    rule = AdamRule(decoupled=False)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward))


class AdamW(OffloadOptimizer):
    __doc__ = """AdamW with offloaded state; the math of ``torch.optim.AdamW`` (decoupled weight decay).

    Example::

        opt = tierstate.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                              offload="cpu")
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
""" + _ENGINE_ARGS

    rule = AdamRule(decoupled=True)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward))


class SGD(OffloadOptimizer):
    __doc__ = """SGD with optional (Nesterov) momentum; the math of ``torch.optim.SGD``.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov, maximize: as ``torch.optim.SGD``.
""" + _ENGINE_ARGS

    rule = SGDRule()

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward))


class Lion(OffloadOptimizer):
    __doc__ = """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    ``update = sign(beta1*m + (1-beta1)*g)``; ``w = w*(1 - lr*wd) - lr*update``;
    ``m = beta2*m + (1-beta2)*g``. State key: ``exp_avg``.

    Args:
        params, lr (default 1e-4), betas (default (0.9, 0.99)), weight_decay, maximize.
""" + _ENGINE_ARGS

    rule = LionRule()

    def __init__(self, params: Iterable, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *,
                 maximize: bool = False, offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward))


class Adagrad(OffloadOptimizer):
    __doc__ = """Adagrad; the math of ``torch.optim.Adagrad`` (state ``step`` and ``sum`` from construction).

    Args:
        params, lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize: as
        ``torch.optim.Adagrad``.
""" + _ENGINE_ARGS

    rule = AdagradRule()

    def __init__(self, params: Iterable, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False,
                 offload: "str | Offload" = "cpu", max_grad_norm: float | None = None,
                 on_nonfinite: str = "skip", telemetry: bool = True,
                 step_in_backward: bool = False) -> None:
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize)
        super().__init__(params, defaults, **_engine_kwargs(offload, max_grad_norm, on_nonfinite, telemetry,
                                                          step_in_backward))
