"""A checkpoint ts.save_optimizer wrote of a torch optimizer with fused=True streams into the tierstate
optimizer of the same name, as its state_dict loads through load_state_dict: torch's implementation
switches say how torch computed, not what (load_optimizer refused it, load_state_dict did not)."""
import torch
import tierstate as ts


def test_torch_fused_checkpoint_streams_into_tierstate(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        model(torch.randn(4, 16)).square().sum().backward()
        ref.step()
        ref.zero_grad()
    ts.save_optimizer(ref, tmp_path / "ckpt")
    twin = torch.nn.Linear(16, 8)
    opt = ts.AdamW(twin.parameters(), lr=1e-3)
    ts.load_optimizer(opt, tmp_path / "ckpt")
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["lr"] == 1e-2
    sd, want = opt.state_dict(), ref.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(sd["state"][0][key], want["state"][0][key], rtol=0, atol=0)
    opt.close()
