"""``model.state_dict()`` and ``model.load_state_dict()`` on a model whose weights stream.

Between uses a streamed parameter has no storage. Until 2026-12-07 ``model.state_dict()``
returned those empty-storage views as the weights (reading one, e.g. to compare or to save,
crashed the process with a segmentation fault; ``torch.save`` wrote no bytes for them), and
``load_state_dict`` copied into them. Now the model's state dict holds a copy of each
streamed weight read from its home, and loading writes through to the home, so torch's
checkpointing, ``save_pretrained`` and Trainer's model save work as on a resident model.
Every case compares with the resident twin bit for bit.
"""
from __future__ import annotations

import io

import pytest
import torch

import tierstate as ts
from tierstate.weights import streamed

from _models import batches, offload, twin

PLACEMENTS = {"cpu": dict(offload="cpu"), "nvme": dict(offload="nvme"),
              "split": dict(offload=ts.Offload(cpu=0.5, nvme=0.5))}


def _stream(model, tmp_path, placement):
    kw = dict(PLACEMENTS[placement])
    if placement != "cpu":
        kw["nvme_dir"] = tmp_path / "weights"
    return offload(model, **kw)


def _train(model, opt, data):
    for ids in data:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _assert_same_dicts(want: dict, got: dict) -> None:
    assert list(got) == list(want)
    differing = [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    assert not differing, f"entries differ: {differing[:6]}"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_holds_the_streamed_weights(kind, placement, dtype, tmp_path):
    ref, model = twin(kind, dtype)
    ws = _stream(model, tmp_path, placement)
    data = batches(3)
    _train(ref, ts.AdamW(ref.parameters(), lr=1e-2, offload="cpu"), data)
    _train(model, ts.AdamW(model.parameters(), lr=1e-2, offload="cpu"), data)

    got = model.state_dict()
    _assert_same_dicts(ref.state_dict(), got)
    for name, p in model.named_parameters():
        if streamed(p) is not None:  # a copy of its own, whole: safe to keep, save or compare
            t = got[name]
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size() and not t.requires_grad

    buffer = io.BytesIO()  # torch's own checkpoint of the model, loaded into a resident model
    torch.save(got, buffer)
    buffer.seek(0)
    fresh, _ = twin(kind, dtype, seed=5)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    ids = data[0]
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, ref(ids).logits)
    ws.close()


def test_keep_vars_and_a_submodule_state_dict(tmp_path):
    ref, model = twin("llama")
    ws = _stream(model, tmp_path, "nvme")
    kept = model.state_dict(keep_vars=True)  # the Parameter objects, as torch gives them
    assert list(kept) == list(ref.state_dict()) and all(kept[n] is p for n, p in model.named_parameters())
    _assert_same_dicts(ref.state_dict(), model.state_dict())
    _assert_same_dicts(ref.model.layers[1].mlp.state_dict(), model.model.layers[1].mlp.state_dict())
    ws.close()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_load_state_dict_writes_the_streamed_weights_and_training_goes_on_from_them(kind, placement, dtype,
                                                                                     tmp_path):
    ref, model = twin(kind, dtype)
    ws = _stream(model, tmp_path, placement)
    ref_opt = ts.AdamW(ref.parameters(), lr=1e-2, offload="cpu")
    opt = ts.AdamW(model.parameters(), lr=1e-2, offload="cpu")
    data = batches(6)
    _train(ref, ref_opt, data[:2])
    _train(model, opt, data[:2])

    other, _ = twin(kind, dtype, seed=7)  # other weights, loaded into both mid-run
    assert ref.load_state_dict(other.state_dict()) == model.load_state_dict(other.state_dict())
    _assert_same_dicts(other.state_dict(), model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(data[2]).logits, other(data[2]).logits)

    _train(ref, ref_opt, data[2:])  # the optimizer's next steps start from the loaded weights
    _train(model, opt, data[2:])
    _assert_same_dicts(ref.state_dict(), model.state_dict())
    ws.close()


def test_load_state_dict_reports_keys_and_shapes_as_torch_does(tmp_path):
    ref, model = twin("llama")
    ws = _stream(model, tmp_path, "nvme")
    before = model.state_dict()
    name = "model.layers.1.self_attn.q_proj.weight"
    assert streamed(model.get_parameter(name)) is not None

    partial = {k: v for k, v in ref.state_dict().items() if k != name}
    partial["extra.weight"] = torch.zeros(3)
    want = ref.load_state_dict(partial, strict=False)
    got = model.load_state_dict(partial, strict=False)
    assert got.missing_keys == want.missing_keys == [name]
    assert got.unexpected_keys == want.unexpected_keys == ["extra.weight"]
    with pytest.raises(RuntimeError, match=rf'Missing key\(s\) in state_dict: "{name}"'):
        model.load_state_dict(partial)

    wrong = dict(ref.state_dict())
    wrong[name] = torch.ones(5, 32)
    with pytest.raises(RuntimeError, match=rf"size mismatch for {name}: copying a param with shape "
                                           r"torch.Size\(\[5, 32\]\) from checkpoint, the shape in current "
                                           r"model is torch.Size\(\[32, 32\]\)"):
        model.load_state_dict(wrong)
    assert torch.equal(ws.read_param(model.get_parameter(name)), before[name])  # left as it was
    ws.close()


def test_submodule_load_state_dict(tmp_path):
    ref, model = twin("gpt2")
    ws = _stream(model, tmp_path, "cpu")
    other, _ = twin("gpt2", seed=3)
    sub = other.transformer.h[2].state_dict()
    model.transformer.h[2].load_state_dict(sub)
    _assert_same_dicts(sub, model.transformer.h[2].state_dict())
    ws.close()


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def _trainer(model, out, opt):
    import transformers

    args = transformers.TrainingArguments(str(out), per_device_train_batch_size=2, max_steps=4, save_steps=2,
                                          report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
                                          data_seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None))


def _weights(model, ws) -> dict:
    return {n: ws.read_param(p) if streamed(p) is not None else p.detach().clone()
            for n, p in model.named_parameters()}


def test_hf_trainer_saves_and_resumes_a_streamed_model(tmp_path):
    """Trainer's checkpoints and ``save_model`` go through the model's state dict, its resume
    through ``load_state_dict``: a model saved from streamed weights is the streamed weights,
    and a run resumed from a checkpoint into a fresh streamed model ends where the whole run did."""
    import transformers

    from _models import gpt2

    model = gpt2()
    ws = offload(model, "nvme", nvme_dir=tmp_path / "w")
    _trainer(model, tmp_path / "out", ts.AdamW(model.parameters(), lr=1e-2)).train()
    _trainer(model, tmp_path / "out", None).save_model(str(tmp_path / "final"))
    want = _weights(model, ws)
    saved = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    _assert_same_dicts(want, {n: p.detach() for n, p in saved.named_parameters()})

    fresh = gpt2(seed=5)
    ws2 = offload(fresh, "nvme", nvme_dir=tmp_path / "w2")
    _trainer(fresh, tmp_path / "out", ts.AdamW(fresh.parameters(), lr=1e-2)).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    _assert_same_dicts(want, _weights(fresh, ws2))
    ws.close()
    ws2.close()


def test_a_state_dict_that_would_not_fit_in_ram_keeps_the_placeholders_and_says_so(tmp_path, monkeypatch):
    """Where the streamed weights do not fit in the available RAM, the model's state dict does
    not read them all in (the OOM killer would end the run): it keeps the empty parameters, as
    before 2026-12-07, so code that takes a few entries (PEFT's adapters) still works, and warns
    naming the way to save them. (The available RAM is what the test sets: no machine here has
    a model larger than its RAM to spare for a unit test.)"""
    from tierstate.weights import module_state

    ref, model = twin("llama")
    ws = _stream(model, tmp_path, "nvme")
    streamed_bytes = sum(ws.block_bytes())
    monkeypatch.setattr(module_state, "available_ram", lambda: module_state.RAM_LEFT_FREE + streamed_bytes - 1)
    with pytest.warns(RuntimeWarning, match=r"do not fit in the available RAM .*tierstate.save_weights"):
        sd = model.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert sd[name].shape == ref.get_parameter(name).shape and sd[name].untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match=f"{name}.*ws.read_param"):  # reading one raises (it crashed)
        sd[name].sum()
    assert torch.equal(sd["model.norm.weight"], ref.state_dict()["model.norm.weight"])  # resident: as ever
    _assert_same_dicts(ref.model.layers[0].state_dict(), model.model.layers[0].state_dict())  # a part: copied

    monkeypatch.setattr(module_state, "available_ram", lambda: module_state.RAM_LEFT_FREE + streamed_bytes)
    _assert_same_dicts(ref.state_dict(), model.state_dict())  # just fits: copies
    ws.close()


def test_a_part_is_copied_after_a_model_state_dict_that_raised_midway(tmp_path, monkeypatch):
    """A model ``state_dict()`` that keeps placeholders (the copies would not fit in RAM) and
    raises midway (here a hook of the user's) left the "placeholders" decision set until the
    next model call: a part's own ``state_dict()`` in between gave placeholders, not copies."""
    from tierstate.weights import module_state

    ref, model = twin("llama")
    ws = _stream(model, tmp_path, "nvme")
    streamed_bytes = sum(ws.block_bytes())
    monkeypatch.setattr(module_state, "available_ram", lambda: module_state.RAM_LEFT_FREE + streamed_bytes - 1)

    def failing_hook(module, state_dict, prefix, local_metadata):
        raise ValueError("a state-dict hook of the user's failed")

    handle = model.model.layers[1].register_state_dict_post_hook(failing_hook)
    with pytest.warns(RuntimeWarning, match="do not fit"), pytest.raises(ValueError, match="of the user's"):
        model.state_dict()
    handle.remove()
    _assert_same_dicts(ref.model.layers[0].state_dict(), model.model.layers[0].state_dict())
    ws.close()


def test_deepcopy_of_a_streamed_model_is_refused_with_the_way_out(tmp_path):
    """An EMA's ``copy.deepcopy(model)`` cloned the empty parameters, which ended the process."""
    import copy

    _, model = twin("llama")
    ws = _stream(model, tmp_path, "cpu")
    for what in (model, model.model.layers[1]):
        with pytest.raises(TypeError, match=r"copy.deepcopy of a model whose weights stream.*state_dict\(\)"):
            copy.deepcopy(what)
    ws.close()


def test_a_failed_read_during_state_dict_names_the_file_and_the_next_call_works(tmp_path):
    """The state dict reads the blocks from their homes: a read that fails raises the OSError
    naming the file (EIO), and the next call, the disk well again, gives the weights."""
    import errno

    from tierstate.io.faults import fail_nth

    ref, model = twin("gpt2", n_layer=6, n_embd=16)
    ws = offload(model, "nvme", nvme_dir=tmp_path / "w", prefetch=0)
    with fail_nth("read", 1, errno.EIO, path_contains=str(tmp_path / "w")) as plan:
        with pytest.raises(OSError) as failed:
            model.state_dict()
    assert plan.fired == 1 and failed.value.errno == errno.EIO and str(tmp_path / "w") in str(failed.value)
    _assert_same_dicts(ref.state_dict(), model.state_dict())
    ws.close()
