"""Model descriptions -> parameter tensors: counts checked against the real modules."""
import pytest
import torch

from plan_models import tiny_gpt
from tierstate.placement.model_spec import (BUILTIN_SHAPES, from_factory, from_hf_config, gpt2_param_numels,
                                            llama_block_numels, llama_param_numels, parse_count, resolve_model)


@pytest.mark.parametrize("text, count", [("124M", 124_000_000), ("7B", 7_000_000_000), ("6.7e9", 6_700_000_000),
                                         ("350k", 350_000), (1234, 1234)])
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("bad", ["seven", "7X", "0", "-3M", ""])
def test_parse_count_rejects_with_an_example(bad):
    with pytest.raises(ValueError, match="parameter count"):
        parse_count(bad)


def test_builtin_gpt2_and_llama_counts_match_the_published_figures():
    # GPT2LMHeadModel reports 124,439,808 (tied head); Llama-2-7b 6,738,415,616; Llama-2-70b 68,976,648,192.
    assert resolve_model("gpt2").numel == 124_439_808
    assert resolve_model("llama-7b").numel == 6_738_415_616
    assert resolve_model("llama-70b").numel == 68_976_648_192
    assert resolve_model("gpt2").largest_param == 50257 * 768  # the token embedding
    assert set(BUILTIN_SHAPES) >= {"gpt2", "gpt2-medium", "llama-7b"}


def test_formulas_match_transformers_modules_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=96, n_head=4, vocab_size=500, n_positions=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == sum(gpt2_param_numels(3, 96, 500, 64))
    lcfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160, vocab_size=300,
                                    num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(lcfg)
    assert sum(p.numel() for p in llama.parameters()) == sum(llama_param_numels(2, 64, 160, 300, 4, 2))


def test_transformers_config_folder_is_read_locally(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=320, n_positions=128).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    assert spec.numel == sum(gpt2_param_numels(2, 64, 320, 128))
    assert spec.shape.n_layer == 2 and spec.shape.hidden == 64 and spec.shape.max_seq_len == 128


def test_missing_config_names_the_alternatives():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="local_files_only"):
        from_hf_config("no-such-org/no-such-model-xyz")


def test_factory_counts_on_the_meta_device_like_the_real_module():
    spec = from_factory("plan_models:tiny_gpt")
    real = [p.numel() for p in tiny_gpt().parameters()]
    assert list(spec.param_numels) == real
    assert spec.shape.n_layer == 2 and spec.shape.hidden == 32


def test_factory_errors_name_the_problem():
    with pytest.raises(ValueError, match="cannot import"):
        from_factory("no_such_module_xyz:build")
    with pytest.raises(ValueError, match="no attribute"):
        from_factory("plan_models:not_here")


def test_factory_parameters_are_told_apart_by_identity_not_by_address():
    """A generator of fresh tensors: each is freed after it is counted and the next may reuse its
    address, so keying by id() took it for a tied weight; a tensor listed twice counts once."""
    assert from_factory("plan_models:fresh_tensors").param_numels == (100, 100, 100, 300)
    assert from_factory("plan_models:tied_list").param_numels == (64, 8)


# published parameter counts of the Llama-architecture shapes (the model cards' figures)
LLAMA_SHAPES = {
    "smollm-135m": (134_515_008, dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      tie_word_embeddings=True)),
    "tinyllama-1.1b": (1_100_048_384, dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632,
                                           num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                           tie_word_embeddings=False)),
    "llama-3.2-1b": (1_235_814_400, dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         tie_word_embeddings=True)),
    "llama-3-8b": (8_030_261_248, dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                       tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", sorted(LLAMA_SHAPES))
def test_llama_shapes_match_the_published_counts_and_the_transformers_module(name):
    published, fields = LLAMA_SHAPES[name]
    spec = resolve_model(name)
    assert spec.numel == published
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    assert sum(p.numel() for p in model.parameters()) == published
    assert spec.block_numels == tuple(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    assert spec.outside_numel == published - sum(spec.block_numels)


def test_a_config_on_the_meta_device_gives_its_blocks_and_counts_a_tied_head_once(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=160, vocab_size=300,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    block = sum(llama_block_numels(64, 160, 4, 2))
    assert spec.block_numels == (block,) * 3
    assert spec.outside_numel == 300 * 64 + 64  # the embedding (= the tied head) and the final norm
    assert spec.numel == sum(llama_param_numels(3, 64, 160, 300, 4, 2, tie_embeddings=True))


def test_a_factory_gives_the_largest_module_list_as_its_blocks():
    spec = from_factory("plan_models:tiny_gpt")
    model = tiny_gpt()
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = max(lists, key=lambda lst: sum(p.numel() for p in lst.parameters()))
    assert spec.block_numels == tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
    assert sum(spec.block_numels) + spec.outside_numel == sum(p.numel() for p in model.parameters())


def test_a_bare_count_has_no_blocks():
    spec = resolve_model("7B")
    assert not spec.blocks_known and spec.block_numels == () and spec.outside_numel == 0
