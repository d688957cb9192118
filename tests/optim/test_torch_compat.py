"""What torch code sees of a tierstate optimizer: state_dict schema and param-group keys equal to
torch's, torch.distributed.checkpoint both ways, optimizer.state readable on every tier, the
nvme_dir shorthand."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tierstate as ts

PAIRS = [(ts.AdamW, torch.optim.AdamW, {}), (ts.Adam, torch.optim.Adam, {}),
         (ts.SGD, torch.optim.SGD, {}), (ts.SGD, torch.optim.SGD, dict(momentum=0.9)),
         (ts.Adagrad, torch.optim.Adagrad, {})]
PAIR_IDS = ["AdamW", "Adam", "SGD", "SGD-momentum", "Adagrad"]


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def run(model, opt, steps: int = 3, seed: int = 7) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=gen)).pow(2).mean().backward()
        opt.step()


def nvme(tmp_path, **kw) -> ts.Offload:
    return ts.Offload(cpu=0.0, nvme=1.0, nvme_dir=tmp_path, subgroup_numel=1024, buffer_count=2, **kw)


def same_groups(ours: list, ref: list) -> bool:
    """Equal param groups; the torch side runs foreach=False (its single-tensor path, the one
    the tolerance is measured against), which is only how torch computes, so that value is not compared."""
    strip = lambda groups: [{k: v for k, v in g.items() if k != "foreach"} for g in groups]  # noqa: E731
    return [set(g) for g in ours] == [set(g) for g in ref] and strip(ours) == strip(ref)


def assert_state_dicts_equal(ours: dict, ref: dict, exact: bool = False) -> None:
    assert same_groups(ours["param_groups"], ref["param_groups"]), (ours["param_groups"], ref["param_groups"])
    assert ours["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert set(ours["state"][i]) - {"master"} == set(st), i
        for k, v in st.items():
            if exact:
                assert torch.equal(ours["state"][i][k], v), (i, k)
            else:
                torch.testing.assert_close(ours["state"][i][k], v, rtol=1e-5, atol=1e-6, msg=f"{i} {k}")


@pytest.mark.parametrize("ts_cls, torch_cls, kw", PAIRS, ids=PAIR_IDS)
def test_param_group_keys_and_values_equal_torchs(ts_cls, torch_cls, kw) -> None:
    ours = ts_cls(mlp().parameters(), **kw)
    ref = torch_cls(mlp().parameters(), **kw)
    assert ours.state_dict()["param_groups"] == ref.state_dict()["param_groups"]
    assert set(ours.defaults) == set(ref.defaults)


@pytest.mark.parametrize("ts_cls, torch_cls, kw", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("placement", ["cpu", "nvme", "split"])
def test_whole_state_dict_equals_torchs(tmp_path, ts_cls, torch_cls, kw, placement) -> None:
    """SGD without momentum has no per-parameter state: no file is opened for it and its
    state_dict's state is empty, as torch's."""
    offload = {"cpu": "cpu", "nvme": nvme(tmp_path),
               "split": ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=tmp_path, subgroup_numel=1024)}[placement]
    m_ours, m_ref = mlp(), mlp()
    ours = ts_cls(m_ours.parameters(), lr=1e-2, offload=offload, **kw)
    ref = torch_cls(m_ref.parameters(), lr=1e-2, foreach=False, **kw)
    assert_state_dicts_equal(ours.state_dict(), ref.state_dict())
    run(m_ours, ours)
    run(m_ref, ref)
    assert_state_dicts_equal(ours.state_dict(), ref.state_dict())
    assert [p in ours.state for p in m_ours.parameters()] == [p in ref.state for p in m_ref.parameters()]
    ours.close()


def _train_dcp_save(model, opt, path) -> None:
    run(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def _dcp_load(model, opt, path) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


@pytest.mark.parametrize("ts_cls, torch_cls, kw", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("direction", ["ts_to_torch", "torch_to_ts"])
def test_dcp_checkpoint_moves_between_tierstate_and_torch(tmp_path, ts_cls, torch_cls, kw, direction) -> None:
    """Saved by one with torch.distributed.checkpoint, loaded by the other, then both trained
    on: the same as torch trained all along."""
    lr = dict(lr=1e-2)
    make_ts = lambda m: ts_cls(m.parameters(), **lr, **kw)  # noqa: E731
    make_torch = lambda m: torch_cls(m.parameters(), **lr, foreach=False, **kw)  # noqa: E731
    save_make, load_make = (make_ts, make_torch) if direction == "ts_to_torch" else (make_torch, make_ts)
    m_save = mlp()
    _train_dcp_save(m_save, save_make(m_save), tmp_path / "ckpt")
    m_load = mlp(seed=5)
    loaded = load_make(m_load)
    _dcp_load(m_load, loaded, tmp_path / "ckpt")
    run(m_load, loaded, 2, seed=9)
    m_ref = mlp()
    ref = make_torch(m_ref)
    run(m_ref, ref, 3)
    run(m_ref, ref, 2, seed=9)
    for a, b in zip(m_load.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_state_dicts_equal(loaded.state_dict(), ref.state_dict())


@pytest.mark.parametrize("placement", ["nvme-fp32", "nvme-bf16", "split-fp32", "cpu-bf16", "device-fp32"])
def test_optimizer_state_serves_every_key_on_every_tier(tmp_path, placement, monkeypatch) -> None:
    """opt.state[p]["exp_avg"] reads state held outside the host tier on demand (a CPU copy);
    iterating opt.state never reads it (frameworks iterate it to move tensors)."""
    tier, dtype = placement.split("-")
    moment = torch.bfloat16 if dtype == "bf16" else torch.float32
    if tier == "device":  # the device tier's own code, run on CPU parameters (see tierstate.Offload)
        monkeypatch.setenv("TIERSTATE_DEVICE_TIER_ON_CPU", "1")
    offload = {"nvme": nvme(tmp_path, moment_dtype=moment),
               "split": ts.Offload(cpu=0.5, nvme=0.5, nvme_dir=tmp_path, subgroup_numel=1024, moment_dtype=moment),
               "device": ts.Offload(gpu=0.5, subgroup_numel=1024),
               "cpu": ts.Offload(moment_dtype=moment)}[tier]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 3))  # 1640 + 123: straddles 1024
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload=offload)
    run_model = lambda: model(torch.randn(2, 40)).sum().backward()  # noqa: E731
    run_model()
    opt.step()
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        st = opt.state[p]
        listed = dict(st.items())
        assert set(listed) <= {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            value = st[key]
            assert value.device.type == "cpu" and value.dtype == moment and value.shape == p.shape
            assert torch.equal(value, sd["state"][i][key]), (i, key)
            assert torch.equal(st.get(key), value)
            assert (key in st) == (key in listed)  # `in` answers like keys(): held entries only
        assert float(st["step"]) == 1.0
        with pytest.raises(KeyError):
            st["max_exp_avg_sq"]  # amsgrad is off: no such state, as in torch
        assert st.get("nope") is None
    if tier == "nvme":  # iterating (what Lightning's optimizer_to_device does) sees only the step tensor
        assert all(set(st) == {"step"} for st in opt.state.values())
        assert all(set(dict(st.items())) == {"step"} for st in opt.state.values())
    opt.close()


def test_nvme_dir_shorthand(tmp_path) -> None:
    opt = ts.AdamW(mlp().parameters(), offload="nvme", nvme_dir=tmp_path / "a")
    assert opt.offload.nvme == 1.0 and opt.offload.nvme_dirs == (tmp_path / "a",)
    assert any((tmp_path / "a").rglob("*.bin"))
    opt.close()
    opt = ts.AdamW(mlp().parameters(), offload=ts.Offload(cpu=0.5, nvme=0.5), nvme_dir=str(tmp_path / "b"))
    assert opt.offload.nvme_dirs == (tmp_path / "b",) and opt.offload.cpu == 0.5
    opt.close()
    with pytest.raises(ValueError, match=r"nvme_dir.*both.*Offload\(nvme_dir="):
        ts.AdamW(mlp().parameters(), offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path / "c"), nvme_dir=tmp_path / "d")
    with pytest.raises(ValueError, match=r"nvme_dir=.*offload='cpu'.*no state on NVMe"):
        ts.AdamW(mlp().parameters(), offload="cpu", nvme_dir=tmp_path)
    with pytest.raises(ValueError, match=r"nvme_dir=.*offload='auto'.*TIERSTATE_NVME_DIR"):
        ts.AdamW(mlp().parameters(), offload="auto", nvme_dir=tmp_path)


@pytest.mark.parametrize("kwargs, expect", [
    (dict(nvme=1.0), (0.0, 0.0, 1.0)),
    (dict(nvme=0.4), (0.0, 0.6, 0.4)),
    (dict(gpu=0.3, nvme=0.5), (0.3, 0.2, 0.5)),
    (dict(gpu=1.0), (0.0 + 1.0, 0.0, 0.0)),
    (dict(), (0.0, 1.0, 0.0)),
    (dict(cpu=0.6, nvme=0.4), (0.0, 0.6, 0.4)),
    (dict(nvme=0.7, gpu=0.3), (0.3, 0.0, 0.7)),
])
def test_offload_fractions_not_given_default_to_the_rest_on_cpu(kwargs, expect) -> None:
    o = ts.Offload(**kwargs)
    assert (o.gpu, o.cpu, o.nvme) == pytest.approx(expect)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(nvme=0.7, gpu=0.6), r"gpu=0.6.*nvme=0.7.*sum to 1.3"),
    (dict(cpu=0.5), r"sum to 0.5"),
    (dict(cpu=0.5, nvme=0.2), r"sum to 0.7"),
])
def test_offload_fractions_that_cannot_sum_to_one(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        ts.Offload(**kwargs)


def test_offload_nvme_shorthand_builds_files(tmp_path) -> None:
    opt = ts.AdamW(mlp().parameters(), offload=ts.Offload(nvme=1.0, nvme_dir=tmp_path))
    assert opt.offload.cpu == 0.0
    assert any(tmp_path.rglob("*.bin"))
    opt.close()
    assert os.path.isdir(tmp_path)


def test_tierstate_checkpoint_of_groups_without_torch_keys_loads_with_them(tmp_path) -> None:
    """A checkpoint whose groups lack torch's implementation switches (written before they were
    carried, or by hand) loads with this optimizer's values, so a later DCP save still matches
    torch's keys; a bad hyper-parameter in it is refused before the optimizer changes."""
    import json

    from tierstate.checkpoint import load_optimizer, save_optimizer
    from tierstate.checkpoint.manifest import seal

    m = mlp()
    opt = ts.AdamW(m.parameters(), lr=1e-2)
    run(m, opt, 2)
    save_optimizer(opt, tmp_path / "ckpt")
    manifests = [p for p in (tmp_path / "ckpt").rglob("*.json") if "param_groups" in p.read_text()]
    assert len(manifests) == 1
    man = json.loads(manifests[0].read_text())

    def groups_of(node):  # the manifest's param_groups list, wherever it sits
        if isinstance(node, dict):
            if "param_groups" in node:
                return node["param_groups"]
            return next((g for v in node.values() if (g := groups_of(v)) is not None), None)
        return None

    for g in groups_of(man):
        for key in ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"):
            g.pop(key, None)
    # an edited manifest must carry its checksum anew (tierstate.checkpoint.manifest.seal)
    manifests[0].write_text(json.dumps(seal(man, man["manifest_checksum"]["algorithm"])))
    m2 = mlp()
    opt2 = ts.AdamW(m2.parameters(), lr=1e-2)
    load_optimizer(opt2, tmp_path / "ckpt")
    assert opt2.state_dict()["param_groups"] == torch.optim.AdamW(mlp().parameters(), lr=1e-2).state_dict()[
        "param_groups"]
    g = groups_of(man)[0]
    g["lr"] = float("inf")
    manifests[0].write_text(json.dumps(seal(man, man["manifest_checksum"]["algorithm"])).replace("Infinity", "1e999"))
    before = opt2.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"param_groups\[0\].*Invalid learning rate"):
        load_optimizer(opt2, tmp_path / "ckpt")
    assert opt2.param_groups[0]["lr"] == before


def test_master_of_a_loaded_torch_state_is_published_as_a_host_view() -> None:
    """bf16 parameters loaded from a torch state dict (no master): the first step makes the
    master, which optimizer.state then lists as a view of the host arena, like every host key."""
    m_ref = mlp()
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2)
    run(m_ref, ref, 1)
    m = mlp().to(torch.bfloat16)
    opt = ts.AdamW(m.parameters(), lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    assert all("master" not in st for st in opt.state.values())
    gen = torch.Generator().manual_seed(3)
    m(torch.randn(6, 4, generator=gen).to(torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    arena = opt.tiers[ts.placement.TierKind.HOST].arenas["master"]
    for p in m.parameters():
        master = dict(opt.state[p])["master"]
        assert master.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert torch.equal(master.to(torch.bfloat16), p.detach())


def test_step_inside_torch_compile_runs_eagerly_and_quietly() -> None:
    """A training step compiled with torch.compile: the optimizer's step runs eagerly (the
    native kernels are opaque to dynamo), with the results of the eager step and none of
    dynamo's graph-break warnings."""
    import warnings

    torch.manual_seed(0)
    net, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref.load_state_dict(net.state_dict())
    ours = ts.AdamW(net.parameters(), lr=1e-2, offload="cpu")
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)

    @torch.compile(backend="eager")
    def step():
        ours.step()

    x = torch.rand(4, 8)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            net(x).square().sum().backward()
            step()
            ours.zero_grad()
            ref(x).square().sum().backward()
            theirs.step()
            theirs.zero_grad()
    noisy = [str(w.message)[:200] for w in caught if "ynamo" in str(w.message) or "trace" in str(w.message)]
    assert not noisy, noisy
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    ours.close()
