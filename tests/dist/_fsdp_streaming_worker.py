"""One rank of tests/dist/test_fsdp_weight_streaming.py, started by torchrun (gloo, CPU).

FSDP2 shards each block of a transformers model (GPT-2 with its tied embedding, Llama) across
the ranks; ``tierstate.offload_weights`` then keeps this rank's shards of the blocks on a tier
(``cpu``, ``nvme``, or ``split``: half the blocks' bytes in RAM, the rest on NVMe) and
``tierstate.AdamW`` (CPU tier) steps them. Each variant trains STEPS steps on a fixed global
batch, with activation checkpointing (non-reentrant), two micro-batches accumulated per step,
global-norm clipping and the blocks' MLP input projection frozen (LoRA-style: frozen weights
streamed); ``resident`` is the same without weight streaming, the reference. ``<tier>-noac``
leaves out activation checkpointing; ``<tier>-mp`` adds FSDP2's ``MixedPrecisionPolicy`` (bf16
compute, fp32 reduction; its reference is ``resident-mp``). ``errors`` records what the user is told where
streaming cannot work (``save_weights`` of shards, blocks FSDP2 did not shard on their own).
``nvme-resume`` trains SAVE_AT steps, saves a
``torch.distributed.checkpoint`` (``get_state_dict`` + ``dcp.save`` inside ``ws.gathered()``),
and continues in a fresh model, streamer and optimizer loaded from it; ``nvme-resume-plain``
does the same without ``gathered()``.

    torchrun --standalone --nproc-per-node N _fsdp_streaming_worker.py OUT --job gpt2=resident,nvme \
        --job llama=resident,split

Rank 0 writes OUT/result-w<N>.pt: per model and variant the losses, the full parameters, and
per rank what the streamed shards held between steps and what streaming did (stats()).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import tierstate as ts

STEPS, SAVE_AT, MICRO, ROWS, SEQ, VOCAB = 10, 5, 2, 8, 16, 97
VARIANTS = ("resident", "cpu", "nvme", "split", "nvme-noac", "nvme-resume", "nvme-resume-plain", "resident-mp",
            "nvme-mp")


def build(name: str, checkpointing: bool, mixed: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":  # wte is tied to lm_head: it stays with the root unit, resident
        model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=40, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                           bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))  # no dropout: a resumed run draws no other masks
        blocks, frozen = model.transformer.h, "mlp.c_fc"
    else:  # the 75-row MLP projections: uneven shards (38 and 37 rows on 2 ranks; 19, 19, 19, 18 on 4)
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=6, hidden_size=40, intermediate_size=75,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                             max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                             pad_token_id=0))
        blocks, frozen = model.model.layers, "mlp.up_proj"
    for block in blocks:
        block.get_submodule(frozen).requires_grad_(False)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kw = {}
    if mixed:  # FSDP2's own mixed precision: fp32 shards (streamed), bf16 compute, fp32 reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def stream(variant: str, model, out: str, tag: str):
    tier = variant.split("-")[0]
    if tier == "resident":
        return None
    where = ts.Offload(cpu=0.5, nvme=0.5) if tier == "split" else tier
    folder = os.path.join(out, f"w-{tag}-rank{{rank}}") if tier != "cpu" else None  # a folder per rank
    return ts.offload_weights(model, where, nvme_dir=folder, prefetch=1)


def batch(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 * step + micro))
    rows = ROWS // world
    return x[rank * rows:(rank + 1) * rows]


def shard_bytes(ws) -> int:
    """Bytes the streamed shards hold in memory right now (0 between steps: they live on their tier)."""
    return sum(pl.fsdp_param._sharded_param_data.untyped_storage().nbytes() for b in ws.blocks for pl in b.places)


def train(model, opt, ws, first: int, last: int) -> tuple[list[float], list[int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, held = [], []
    for step in range(first, last + 1):
        total = torch.zeros(())
        for micro in range(MICRO):
            x = batch(step, micro, rank, world)
            loss = model(x, labels=x).loss / MICRO
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if ws is not None:
            held.append(shard_bytes(ws))
    return losses, held


def optimizer(model):
    return ts.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
                    offload="cpu")


def gathered(ws):
    """Every streamed shard in memory (the model's state dict reads them), or nothing to do."""
    return ws.gathered() if ws is not None else contextlib.nullcontext()


def full_params(model, ws) -> dict:
    def gather():
        return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    with gathered(ws):
        return gather()


def run(name: str, variant: str, out: str) -> dict:
    world = dist.get_world_size()
    tag = f"{name}-{variant}-w{world}"
    mixed = variant.endswith("-mp")
    model = build(name, checkpointing="noac" not in variant, mixed=mixed)
    ws = stream(variant, model, out, tag)
    opt = optimizer(model)
    if "resume" in variant:
        # nvme-resume-plain: no gathered() (the model's state dict reads and writes the homes)
        around = gathered if not variant.endswith("plain") else (lambda ws: contextlib.nullcontext())
        losses, held = train(model, opt, ws, 1, SAVE_AT)
        ckpt = os.path.join(out, f"ckpt-{tag}")
        with around(ws):  # the model's state dict reads the shards
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        if ws is not None:
            ws.close()
        del model, opt, ws
        model = build(name, checkpointing=True)
        ws = stream(variant, model, out, tag + "-resumed")
        opt = optimizer(model)
        with around(ws):  # loading writes the shards in place: kept in their images
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=ckpt)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        more, held2 = train(model, opt, ws, SAVE_AT + 1, STEPS)
        losses, held = losses + more, held + held2
    else:
        losses, held = train(model, opt, ws, 1, STEPS)
    stats = ws.stats() if ws is not None else None  # of training: before gathered() holds every block
    res = {"losses": losses, "params": full_params(model, ws)}
    per_rank = {"held": held, "stats": stats,
                "block_bytes": ws.block_bytes() if ws is not None else [],
                "streamed_bytes": sum(b.nbytes for b in ws.blocks) if ws is not None else 0}
    # the blocks' whole weights (every rank's shards together) and the most FSDP2 pads a shard
    # by: one row per parameter, so each rank's share can be checked against total / N
    whole = [sum(p.numel() * p.element_size() for p in b.module.parameters()) for b in ws.blocks] if ws else []
    pad = [sum(p.numel() // max(p.shape[0], 1) * p.element_size() if p.dim() else 0 for p in b.module.parameters())
           for b in ws.blocks] if ws else []
    per_rank["whole_block_bytes"], per_rank["pad_bytes"] = whole, pad
    ranks = [None] * world
    dist.all_gather_object(ranks, per_rank)
    res["ranks"] = ranks
    if ws is not None:
        ws.close()
    return res


def errors(name: str, out: str) -> dict:
    """What the user is told when streaming meets FSDP2 in a way that cannot work."""
    said = {}

    def message(fn):
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return None

    model = build(name, checkpointing=False)
    ws = stream("cpu", model, out, "errors")
    said["save_weights"] = message(lambda: ts.save_weights(model, os.path.join(out, "w.safetensors")))
    # read_param/write_param: this rank's shard, in its local shape
    p = model.transformer.h[1].attn.c_attn.weight
    shard = ws.read_param(p)
    with ws.gathered():
        said["read_param_is_the_shard"] = torch.equal(shard, p._local_tensor)
    ws.write_param(p, shard * 2)
    with ws.gathered():
        said["write_param_is_kept"] = torch.equal(p._local_tensor, shard * 2)
    said["write_param_global_shape"] = message(lambda: ws.write_param(p, torch.zeros(p.shape)))
    ws.close()
    from transformers import GPT2Config, GPT2LMHeadModel

    root_only = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=40, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    fully_shard(root_only)  # the blocks are not units of their own: FSDP2 gathers them all at once
    said["root_only"] = message(lambda: ts.offload_weights(root_only, "cpu"))
    return said


def touches(name: str, out: str) -> dict:
    """What touching a streamed shard between its block's uses does (tests/dist/test_fsdp_shard_touch.py):
    each case's exception (type, message), or "returned" if it ran; then whether every
    streamed shard still holds what it held before the cases, and the loss of a step after."""
    model = build(name, checkpointing=False)
    ws = stream("cpu", model, out, "touch")
    opt = ts.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(ROWS * SEQ).remainder(VOCAB).view(ROWS, SEQ)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    p = model.transformer.h[1].mlp.c_proj.weight
    streamed = list(model.transformer.h.parameters())  # the blocks stream; the root's parameters stay
    before = [ws.read_param(q) for q in streamed]
    cases = {
        "sum": lambda: p.sum(), "norm": lambda: p.norm(), "clone": lambda: p.clone(), "mul_": lambda: p.mul_(2),
        "add": lambda: p + 1, "to_local": lambda: p.to_local().sum(), "full_tensor": lambda: p.full_tensor(),
        "data_set": lambda: setattr(p, "data", torch.zeros_like(p)),
        "redistribute": lambda: p.redistribute(p.device_mesh, p.placements),
        "data": lambda: p.data.sum(), "detach": lambda: p.detach().clone(), "repr": lambda: repr(p),
        "format": lambda: f"{p}", "save": lambda: torch.save(p, os.path.join(out, f"p{dist.get_rank()}.pt")),
        "deepcopy": lambda: __import__("copy").deepcopy(p),
        "parameters_to_vector": lambda: torch.nn.utils.parameters_to_vector(model.transformer.h[1].mlp.parameters()),
        "half": lambda: model.half(), "to_float64": lambda: model.to(torch.float64), "to_cpu": lambda: model.to("cpu"),
        "torch_sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1).step(),
    }
    said: dict = {"name": p.__class__.__name__, "shape": tuple(p.shape), "dtype": p.dtype, "numel": p.numel()}
    for case, fn in cases.items():
        try:
            fn()
            said[case] = "returned"
        except Exception as exc:  # noqa: BLE001 - what the user would see is the point
            said[case] = (type(exc).__name__, str(exc))
    said["unchanged"] = all(torch.equal(ws.read_param(q), b) for q, b in zip(streamed, before))
    with ws.gathered():
        said["inside_gathered"] = float(p.to_local().float().sum()) == float(ws.read_param(p).float().sum())
        kept = {"kept_to_local": p.to_local(), "kept_detach": p.detach(), "kept_view": p.view(-1)}
        saved = os.path.join(out, f"held{dist.get_rank()}.pt")
        torch.save(p, saved)  # with memory: saved as the DTensor it is
        copied = __import__("copy").deepcopy(p)
        try:  # with memory too: the parameter would no longer be its block's
            p.data = torch.zeros_like(p)
            said["data_set_held"] = "returned"
        except RuntimeError as exc:
            said["data_set_held"] = ("RuntimeError", str(exc))
        said["deepcopy_held"] = (type(copied).__name__, torch.equal(copied.to_local(), p.to_local()))
    said["saved_class"] = type(torch.load(saved, weights_only=False)).__name__
    said["deepcopy_keeps_values"] = torch.equal(copied.to_local(), ws.read_param(p))
    for case, alias in kept.items():  # aliases of the shard taken while it had memory, read after
        try:
            alias.sum()
            said[case] = "returned"
        except Exception as exc:  # noqa: BLE001
            said[case] = (type(exc).__name__, str(exc))
    # a model state dict whose copies would not fit in RAM keeps the parameters as placeholders
    from tierstate.weights import module_state  # noqa: PLC0415
    fits, module_state.available_ram = module_state.available_ram, lambda: 0
    try:
        import warnings  # noqa: PLC0415
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "do not fit in the available RAM"
            entry = model.state_dict()["transformer.h.1.mlp.c_proj.weight"]
    finally:
        module_state.available_ram = fits
    try:
        entry.sum()
        said["placeholder"] = "returned"
    except Exception as exc:  # noqa: BLE001
        said["placeholder"] = (type(exc).__name__, str(exc))
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    said["loss_after"] = float(loss)
    ws.close()
    said["closed_class"] = p.__class__.__name__
    return said


def main() -> None:
    # a rank ended once with SIGSEGV under load (2026-12-07, not reproduced since): its Python
    # stack goes to stderr, which the test shows with the failed launch
    faulthandler.enable()
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--job", action="append", required=True,
                   help=f"MODEL=VARIANT,...: MODEL gpt2 or llama, VARIANT one of {', '.join(VARIANTS)}, errors "
                        "or touch")
    args = p.parse_args()
    dist.init_process_group("gloo")
    result = {}
    for job in args.job:  # one launch for every model: each torchrun start costs 10-20 s on 2 cores
        model, _, variants = job.partition("=")
        jobs = {"errors": errors, "touch": touches}
        result[model] = {v: jobs[v](model, args.out) if v in jobs else run(model, v, args.out)
                         for v in variants.split(",")}
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(args.out, f"result-w{dist.get_world_size()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
