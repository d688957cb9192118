"""The demo's GPT: shapes, causality, the tied head, the presets' sizes."""
import pytest
import torch

from tierstate.demo.model import GPT, MODEL_PRESETS, GPTConfig


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny")).eval()


def test_logits_shape(tiny):
    tokens = torch.randint(0, 256, (3, 17))
    assert tiny(tokens).shape == (3, 17, 256)


def test_a_future_token_does_not_change_earlier_logits(tiny):
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        before, after = tiny(tokens), tiny(changed)
    torch.testing.assert_close(after[:, :20], before[:, :20], rtol=0, atol=1e-6)
    # ...while the changed position and those after it do see the change.
    assert (after[:, 20:] - before[:, 20:]).abs().amax(dim=-1).min() > 1e-4


def test_output_head_is_the_token_embedding(tiny):
    names = [name for name, _ in tiny.named_parameters()]
    assert not any("head" in name for name in names)
    tokens = torch.randint(0, 256, (1, 8))
    tiny.zero_grad()
    tiny(tokens).sum().backward()
    # Rows of tokens absent from the input still get gradient: through the head.
    absent = torch.ones(256, dtype=torch.bool)
    absent[tokens.flatten()] = False
    assert tiny.token_embedding.weight.grad[absent].abs().sum() > 0
    tiny.zero_grad()


@pytest.mark.parametrize("name, millions", [("tiny", 0.2), ("small", 10), ("medium", 50), ("large", 120)])
def test_presets_have_their_advertised_size(name, millions):
    config = GPTConfig.preset(name)
    with torch.device("meta"):  # shapes only: no memory, no time
        model = GPT(config)
    count = sum(p.numel() for p in model.parameters())
    assert count == config.num_parameters()
    assert 0.85 * millions * 1e6 < count < 1.2 * millions * 1e6


def test_bad_configurations_name_the_argument(tiny):
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_layer=1, n_head=3, d_model=64)
    with pytest.raises(ValueError, match="d_model"):
        GPTConfig(n_layer=1, n_head=1, d_model=0)
    with pytest.raises(ValueError, match="'huge'.*tiny"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="max_seq_len=256"):
        tiny(torch.zeros(1, 257, dtype=torch.long))
    assert set(MODEL_PRESETS) == {"tiny", "small", "medium", "large"}
