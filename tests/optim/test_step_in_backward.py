"""step_in_backward=True: sub-groups updated during backward, bit for bit the plain step.

The model ties its input embedding to its output head (like GPT-2), so one parameter's
gradient is final only at the very end of backward, and has a branch that is skipped on
some steps (its parameters get no gradient there). Sub-groups are 1 Ki elements, so every
layer spans several and several layers share one: updates happen during backward and
some are left for step().

On CPU parameters the updates run on the backward thread itself; the worker thread that
accelerators use is run here too (``where="worker"``) by switching the updater over before
the first backward (see [Note: updates on the backward thread]).
"""
from __future__ import annotations

import logging

import pytest
import torch

import tierstate as ts
from tierstate.placement import TierKind

VOCAB, WIDTH = 96, 24
SG = 1024  # the smallest sub-group: many per layer, straddling ones too


class TiedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.up = torch.nn.Linear(WIDTH, 64)
        self.down = torch.nn.Linear(64, WIDTH)
        self.side = torch.nn.Linear(WIDTH, WIDTH)  # used on even steps only
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        if use_side:
            h = h + self.side(h)
        return self.head(self.norm(h))


def make_net(dtype: torch.dtype) -> TiedNet:
    torch.manual_seed(0)
    return TiedNet().to(dtype)


def loss_of(net: TiedNet, step: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (4, 12), generator=gen)
    logits = net(x, use_side=step % 2 == 0)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x.reshape(-1))


def train(net: TiedNet, opt, steps: int = 8) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        loss = loss_of(net, i, gen)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def offload(kind: str, tmp_path, tag: str) -> ts.Offload:
    if kind == "cpu":
        return ts.Offload(cpu=1.0, subgroup_numel=SG)
    folder = tmp_path / tag
    if kind == "nvme":
        return ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=folder, subgroup_numel=SG, buffer_count=3)
    return ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=folder, subgroup_numel=SG, buffer_count=2)


WHERE = ["backward-thread", "worker"]


def run_updates_on(opt, where: str):
    """Make ``opt`` (built with step_in_backward=True) update on ``where``; returns ``opt``."""
    opt._engine.backward.inline = where == "backward-thread"
    return opt


def assert_same_state(a, b) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        assert sa[index].keys() == sb[index].keys()
        for key in sa[index]:
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", ["cpu", "nvme", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_as_the_plain_step(kind: str, dtype: torch.dtype, where: str, tmp_path) -> None:
    nets = [make_net(dtype) for _ in range(2)]
    opts = [ts.AdamW(n.parameters(), lr=1e-2, weight_decay=0.1, offload=offload(kind, tmp_path, f"o{i}"),
                     step_in_backward=bool(i)) for i, n in enumerate(nets)]
    run_updates_on(opts[1], where)
    losses = [train(n, o) for n, o in zip(nets, opts)]
    assert losses[0] == losses[1]
    assert losses[1][-1] < losses[1][0]
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p, q)
    assert_same_state(*opts)
    assert opts[1].last_grad_norm == pytest.approx(opts[0].last_grad_norm, rel=1e-6)
    for o in opts:
        o.close()


CASES = {
    "sgd-nesterov": (lambda ps: ts.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, offload=ts.Offload(subgroup_numel=SG),
                                       step_in_backward=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    "adamw-amsgrad": (lambda ps: ts.AdamW(ps, lr=1e-2, amsgrad=True, offload=ts.Offload(subgroup_numel=SG),
                                          step_in_backward=True),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optimizer(case: str) -> None:
    """fp32 against torch itself (not only against our plain step), every state key.

    Tolerance as tests/optim/test_parity.py: fused fp32 kernel vs torch's op-by-op rounding."""
    make_ours, make_ref = CASES[case]
    ours_net, ref_net = make_net(torch.float32), make_net(torch.float32)
    ours, ref = make_ours(list(ours_net.parameters())), make_ref(list(ref_net.parameters()))
    train(ours_net, ours)
    train(ref_net, ref)
    for p, q in zip(ours_net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    s_ours, s_ref = ours.state_dict()["state"], ref.state_dict()["state"]
    assert s_ours.keys() == s_ref.keys()
    for index in s_ref:
        for key, value in s_ref[index].items():
            torch.testing.assert_close(s_ours[index][key], value, rtol=1e-5, atol=1e-6)
    ours.close()


@pytest.mark.parametrize("where", WHERE)
def test_state_moves_during_backward(where: str) -> None:
    """The last layers' sub-groups are updated while backward still runs; the tied embedding
    (final only when backward ends) is not, until its hook fires."""
    net = make_net(torch.float32)
    opt = run_updates_on(ts.AdamW(net.parameters(), lr=1e-2, offload=ts.Offload(subgroup_numel=SG),
                                  step_in_backward=True), where)
    train(net, opt, steps=1)  # the first step updates nothing during backward (it learns the passes per step)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    seen = {}

    def in_backward(grad: torch.Tensor) -> None:
        # runs when backward reaches the embedding's output: every later layer is done
        opt._engine.backward._queue.join()  # (worker) let it finish what backward handed it so far
        seen.update({name: not torch.equal(p, before[name]) for name, p in net.named_parameters()})

    def watch(module, args, out: torch.Tensor) -> None:
        out.register_hook(in_backward)

    net.emb.register_forward_hook(watch)
    loss_of(net, 0, torch.Generator().manual_seed(1)).backward()
    opt.step()
    assert seen["down.weight"] and seen["side.weight"] and seen["norm.bias"]
    assert not seen["emb.weight"]
    assert not torch.equal(net.emb.weight, before["emb.weight"])
    lanes = opt.stats().lanes
    if where == "worker":
        assert lanes["backward-update"]["cpu_update"] > 0
    else:  # booked on the thread that ran backward, not on a lane of its own
        assert "backward-update" not in lanes and lanes["main"]["cpu_update"] > 0
    opt.close()


def test_backward_thread_never_waits_on_the_disk(tmp_path) -> None:
    """On the backward thread an NVMe sub-group is updated during backward only if its record
    has landed; the others wait for a later hook or step() (backward itself never blocks).

    Whether a read lands before backward's first hook is a race with the disk (CI once saw none
    land in four steps), so from the second step on the test lets the pool's reads land before
    backward starts: then the first record of the plan is in RAM, and the rest of the plan (more
    records than the two buffers hold) still has to wait for step()."""
    net = make_net(torch.float32)
    opt = ts.AdamW(net.parameters(), lr=1e-2, step_in_backward=True,
                   offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=SG, buffer_count=2))
    nvme = opt.tiers[TierKind.NVME]
    acquire = nvme.acquire
    calls = []  # (inside backward(), record already in RAM)
    inside = [False]

    def watched(sg):
        calls.append((inside[0], nvme.ready(sg)))
        return acquire(sg)

    nvme.acquire = watched
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        loss = loss_of(net, step, gen)
        if step > 0:  # step() planned this backward and started reading its first records
            nvme.drain()
        inside[0] = True
        loss.backward()
        inside[0] = False
        opt.step()
        opt.zero_grad()
    during = [ready for in_backward, ready in calls if in_backward]
    assert during and all(during)  # updates did happen during backward, none of them waited
    assert len(calls) > len(during)  # ... and some were left for step()
    opt.close()


def test_nvme_plan_reads_the_next_backward_ahead(tmp_path) -> None:
    """After a step the NVMe pool starts on the next backward's first record (written back and
    read during forward) and keeps the rest of what it holds: those come last in the plan."""
    net = make_net(torch.float32)
    opt = ts.AdamW(net.parameters(), lr=1e-2, step_in_backward=True,
                   offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=SG, buffer_count=2))
    train(net, opt, steps=2)
    nvme = opt.tiers[TierKind.NVME]
    nvme.drain()
    plan = [sg.index for sg in opt._engine.backward.expected_order if sg.tier is TierKind.NVME]
    assert len(plan) > 2 * 2  # more records than the pool holds, twice over
    resident = set(nvme._resident)
    assert len(resident) == 2 and plan[0] in resident  # window W = max(1, 2 // 4) = 1
    assert resident - {plan[0]} <= set(plan[len(plan) // 2:])  # not evicted: needed late
    opt.close()


def test_more_backward_passes_than_the_last_step_raises() -> None:
    """Accumulation is learned from the first step (tests/optim/test_speculative_backward.py); a
    step with more backward passes than that finds its updates already made."""
    net = make_net(torch.float32)
    opt = ts.AdamW(net.parameters(), offload=ts.Offload(subgroup_numel=SG), step_in_backward=True)
    gen = torch.Generator().manual_seed(1)
    train(net, opt, steps=1)
    loss_of(net, 1, gen).backward()
    with pytest.raises(RuntimeError, match="backward pass 2 before step"):
        loss_of(net, 1, gen).backward()
    opt.close()


@pytest.mark.parametrize("where", WHERE)
def test_nonfinite_gradient_updates_each_parameter_wholly_or_not_at_all(where: str) -> None:
    net = make_net(torch.float32)
    opt = run_updates_on(ts.AdamW(net.parameters(), lr=1e-2, offload=ts.Offload(subgroup_numel=SG),
                                  step_in_backward=True), where)
    train(net, opt, steps=1)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    steps_before = {name: opt.state[p]["step"].item() for name, p in net.named_parameters() if p in opt.state}
    # an inf reaches the up-projection's gradient: later in backward than the norm/down layers
    poison = net.up.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    loss_of(net, 1, torch.Generator().manual_seed(2)).backward()
    with pytest.raises(FloatingPointError, match=r"non-finite gradient.*step_in_backward=True"):
        opt.step()
    for name, p in net.named_parameters():
        if name not in steps_before:
            continue
        stepped = opt.state[p]["step"].item() == steps_before[name] + 1
        changed = not torch.equal(p, before[name])
        assert stepped == changed, name  # each parameter wholly updated or wholly untouched
    assert torch.equal(net.up.weight, before["up.weight"])
    assert opt.skipped_steps == 1
    opt.zero_grad()
    poison.remove()
    train(net, opt, steps=1)  # training goes on after the error
    assert torch.isfinite(net.up.weight).all()
    opt.close()


def test_zero_grad_without_step_completes_the_step(caplog) -> None:
    nets = [make_net(torch.float32) for _ in range(2)]
    opts = [ts.AdamW(n.parameters(), lr=1e-2, offload=ts.Offload(subgroup_numel=SG), step_in_backward=b)
            for n, b in zip(nets, (False, True))]
    gen = [torch.Generator().manual_seed(1) for _ in range(2)]
    loss_of(nets[0], 1, gen[0]).backward()
    opts[0].step()
    opts[0].zero_grad()
    loss_of(nets[1], 1, gen[1]).backward()
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        opts[1].zero_grad()
    assert "completing the step" in caplog.text
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p, q)
    for o in opts:
        o.close()


def test_refuses_what_it_cannot_do() -> None:
    net = make_net(torch.float32)
    with pytest.raises(TypeError, match="step_in_backward must be True or False"):
        ts.AdamW(net.parameters(), step_in_backward="yes")


def test_parameter_unfrozen_later_is_refused_not_dropped() -> None:
    net = make_net(torch.float32)
    net.side.weight.requires_grad_(False)
    opt = ts.AdamW(net.parameters(), offload=ts.Offload(subgroup_numel=SG), step_in_backward=True)
    net.side.weight.requires_grad_(True)
    loss_of(net, 0, torch.Generator().manual_seed(1)).backward()
    with pytest.raises(RuntimeError, match="frozen when the optimizer was built"):
        opt.step()
    opt.close()


def _refused_under_process_group(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        net = make_net(torch.float32)
        try:
            ts.AdamW(net.parameters(), step_in_backward=True)
            out.put((rank, "accepted"))
        except ValueError as exc:
            out.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def test_refused_under_data_parallel_process_group() -> None:
    """Two real gloo ranks: DDP/FSDP reduce gradients after the hooks, so the mode is refused."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_refused_under_process_group, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert set(results) == {0, 1}
    for message in results.values():
        assert "process group of 2 ranks" in message and "step_in_backward=False" in message


def test_optimizer_is_collected_and_its_hooks_go_quiet(tmp_path) -> None:
    """The hooks on the parameters must not keep the optimizer (its arenas, its NVMe files) alive."""
    import gc
    import weakref

    net = make_net(torch.float32)
    opt = ts.AdamW(net.parameters(), step_in_backward=True,
                   offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=SG, buffer_count=2))
    train(net, opt, steps=1)
    files = list((tmp_path / "s").iterdir())
    assert files
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    assert not any(f.exists() for f in files if f.suffix != ".lock")  # closed: the state files are gone
    loss_of(net, 1, torch.Generator().manual_seed(1)).backward()  # no hook of the dead optimizer fires


@pytest.mark.parametrize("where", WHERE)
def test_masters_read_between_backward_and_step_hold_the_weights(where: str, tmp_path) -> None:
    """On a parameter's first step its NVMe master pieces are copied in by their updates; a
    state read between backward and step() (the side branch's sub-groups wait for step() on odd
    steps) must still see every master equal to its weight (weight == master rounded)."""
    net = make_net(torch.bfloat16)
    opt = run_updates_on(ts.AdamW(net.parameters(), lr=1e-2, step_in_backward=True,
                                  offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s",
                                                     subgroup_numel=SG, buffer_count=2)), where)
    gen = torch.Generator().manual_seed(1)
    params = list(net.parameters())
    for step in (1, 2, 3):
        loss_of(net, step, gen).backward()
        state = opt.state_dict()["state"]
        for index, entry in state.items():
            if "master" in entry:
                assert torch.equal(entry["master"].bfloat16().reshape(params[index].shape), params[index].detach())
        opt.step()
        opt.zero_grad()
    opt.close()


def test_close_between_backward_and_step_stops_the_worker() -> None:
    net = make_net(torch.float32)
    opt = run_updates_on(ts.AdamW(net.parameters(), offload=ts.Offload(subgroup_numel=SG), step_in_backward=True),
                         "worker")
    train(net, opt, steps=1)  # the first step updates nothing during backward
    loss_of(net, 1, torch.Generator().manual_seed(1)).backward()
    worker = opt._engine.backward._thread
    assert worker is not None and worker.is_alive()
    opt.close()
    assert not worker.is_alive()
    loss_of(net, 1, torch.Generator().manual_seed(1)).backward()  # the hooks are gone with it


@pytest.mark.parametrize("where", WHERE)
def test_state_dict_between_backward_and_step_waits_for_the_worker(where: str, tmp_path) -> None:
    """Reading the state while backward's updates are in flight goes through the NVMe tier only
    after the worker is done with it (or, on the backward thread, after the sub-groups left
    waiting for their records are updated); the step then finishes as if nothing had been read."""
    nets = [make_net(torch.float32) for _ in range(2)]
    opts = [ts.AdamW(n.parameters(), lr=1e-2, step_in_backward=True,
                     offload=ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path / f"o{i}", subgroup_numel=SG,
                                        buffer_count=2)) for i, n in enumerate(nets)]
    run_updates_on(opts[1], where)
    gens = [torch.Generator().manual_seed(1) for _ in nets]
    for step in range(3):
        for i, (net, opt) in enumerate(zip(nets, opts)):
            loss_of(net, step, gens[i]).backward()
            if i == 1:
                opt.state_dict()
            opt.step()
            opt.zero_grad()
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(p, q)
    assert_same_state(*opts)
    for o in opts:
        o.close()


@pytest.mark.parametrize("where", ["backward-thread", "worker"])
def test_updates_during_backward_keep_the_nvme_plan(where: str, tmp_path) -> None:
    """step() tells the NVMe tier the next backward's order (its read-ahead plan); updating a
    sub-group during backward must not re-plan the tier around that one sub-group, or its reads
    ahead stop and step() waits on the disk (GPT-2 124M: opt.step() 0.02 s -> 1.0 s)."""
    net = make_net(torch.float32)
    opt = run_updates_on(ts.AdamW(net.parameters(), lr=1e-2, step_in_backward=True, offload=ts.Offload(
        cpu=0.0, nvme=1.0, nvme_dir=tmp_path / "s", subgroup_numel=SG, buffer_count=2)), where)
    nvme = opt.tiers[TierKind.NVME]
    plans = []
    schedule = nvme.schedule

    def recording_schedule(subgroups, keep_order=False):
        plans.append(([sg.index for sg in subgroups], keep_order))
        return schedule(subgroups, keep_order=keep_order)

    nvme.schedule = recording_schedule
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        plans.clear()
        loss_of(net, step, gen).backward()
        opt._engine.backward.finish()  # (worker) every hand-over handled
        # (the first step updates nothing during backward: it learns how many passes make a step)
        assert opt._engine.backward.done or step == 0, "some sub-groups are updated during backward"
        assert plans == [], f"backward re-planned the NVMe tier: {plans}"
        opt.step()
        opt.zero_grad()
        full = [p for p, keep in plans if keep]
        assert len(full) == 1 and len(full[0]) == len(nvme.subgroups)  # step() planned the next backward whole
    opt.close()


@pytest.mark.parametrize("cls, all_frozen", [(ts.Adagrad, False), (ts.Adagrad, True), (ts.AdamW, True), (ts.SGD, True)])
def test_frozen_parameters_then_unfrozen_train_as_torch(cls, all_frozen) -> None:
    """A parameter frozen at construction that Adagrad keeps state for (as torch's does), or all
    of them (torch takes such an optimizer; its step does nothing until one is unfrozen), then
    unfrozen: the mode trains as torch's optimizer (found 2026-12-07: Adagrad raised torch's
    "cannot register a hook on a tensor that doesn't require gradient" at construction, and an
    optimizer over frozen parameters only was refused). Other rules keep no state for a frozen
    parameter, and one unfrozen while updates run in backward is refused (see
    test_parameter_unfrozen_later_is_refused_not_dropped)."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    for net in nets:
        (net if all_frozen else net[0]).requires_grad_(False)
    kw = dict(lr=1e-2, momentum=0.9) if cls is ts.SGD else dict(lr=1e-2)
    ours = cls(nets[0].parameters(), step_in_backward=True, **kw)
    ref = getattr(torch.optim, cls.__name__)(nets[1].parameters(), foreach=False, **kw)
    gen = torch.Generator().manual_seed(3)
    for step in range(8):
        if step == 3:
            for net in nets:
                net.requires_grad_(True)
        x = torch.randn(5, 16, generator=gen)
        for net, opt in zip(nets, (ours, ref)):
            if any(p.requires_grad for p in net.parameters()):
                net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(*(net.parameters() for net in nets)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    ours.close()
