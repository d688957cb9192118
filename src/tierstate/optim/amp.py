"""Loss scalers: ``torch.amp.GradScaler``'s contract with an optimizer, read into a Scaling.

GradScaler hands itself to optimizers whose ``step()`` takes ``grad_scaler`` (and warns that
this contract is being deprecated). tierstate needs that contract: its gradients live on the
host, where GradScaler's own inf check cannot see them, so the check and its record for
``scaler.update()`` happen in the step (:class:`tierstate.pipeline.Scaling`).
"""
from __future__ import annotations

import warnings

from ..pipeline import Scaling
from ..pipeline.decision import found_inf_by_unscale

warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def scaling_of(opt, grad_scaler, host_copies: bool) -> Scaling:
    """What ``grad_scaler`` (or GradScaler's attribute protocol on ``opt``) says of this step.

    ``host_copies``: gradients were copied to host buffers during backward (the gradient
    stream), where ``scaler.unscale_(opt)`` never unscaled them.
    """
    if grad_scaler is None and (getattr(opt, "grad_scale", None) is not None
                                or getattr(opt, "found_inf", None) is not None):
        # GradScaler's attribute protocol (used when a wrapper hides our grad_scaler argument);
        # found_inf without grad_scale: nothing to unscale, but an inf found skips the step, as
        # torch's fused step skips it
        scale = getattr(opt, "grad_scale", None)
        found = getattr(opt, "found_inf", None)
        return Scaling(1.0 if scale is None else 1.0 / float(scale),
                       found is not None and bool(float(found)), None, True)
    if grad_scaler is None or not grad_scaler.is_enabled():
        return Scaling()
    record = grad_scaler._per_optimizer_states[id(opt)]  # GradScaler's own keying
    # Gradients read from param.grad were unscaled in place by scaler.unscale_(opt);
    # host copies made by the gradient stream never were.
    found = found_inf_by_unscale(record)
    if found is not None and not host_copies:
        return Scaling(1.0, found, record, True)
    return Scaling(1.0 / grad_scaler.get_scale(), False, record, True)
