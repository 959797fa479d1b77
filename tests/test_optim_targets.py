"""engine.optim.target_linear_parameters: transformers' optim_target_modules rule, stricter errors."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.optim import target_linear_parameters
from engine.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _modules(weights):
    return sorted(name.removesuffix(".weight") for name in weights)


def _trainer_rule(model, target_modules):
    """What transformers' Trainer selects (its own helper), for comparison."""
    from transformers.trainer_utils import check_target_module_exists

    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and check_target_module_exists(target_modules, name))


@pytest.mark.parametrize("target_modules", [
    r".*attn.*",                                 # a string is a whole-name regex
    [r".*attn.*", r".*mlp.*"],                   # a list of regexes (the Trainer docs' example)
    ["q_proj", "v_proj"],                        # substrings of module names
    ["model.layers.0.mlp.down_proj", "lm_head"],  # full names
    "model.layers.1.self_attn.o_proj",           # one full name as a string
    ["attn", "mlp"],                             # substrings that also select containers
])
def test_selection_equals_trainers(model, target_modules):
    weights = target_linear_parameters(model, target_modules)
    assert _modules(weights) == _trainer_rule(model, target_modules)
    params = dict(model.named_parameters())
    assert all(weights[name] is params[name] for name in weights)
    assert list(weights) == [name for name in params if name in weights]  # named_parameters order


def test_all_linear_takes_every_linear_layer(model):
    for spelling in ("all-linear", "all_linear"):
        weights = target_linear_parameters(model, spelling)
        assert len(weights) == 2 * 7 + 1  # 7 projections per layer + lm_head
        assert "lm_head.weight" in weights


def test_nothing_set_is_refused(model):
    with pytest.raises(ConfigError, match=r"train\.optim_target_modules: galore_adamw needs target modules"):
        target_linear_parameters(model, None, user="galore_adamw")


@pytest.mark.parametrize("target_modules", [r".*nothing.*", ["nothing"], []])
def test_matching_nothing_is_refused(model, target_modules):
    with pytest.raises(ConfigError, match=r"train\.optim_target_modules: .* selects no nn\.Linear module.*"
                                          r"Linear modules here: model\.layers\.0\.self_attn\.q_proj"):
        target_linear_parameters(model, target_modules)


def test_non_linear_module_named_is_refused(model):
    with pytest.raises(ConfigError, match=r"model\.embed_tokens \(Embedding\).* only projects nn\.Linear"):
        target_linear_parameters(model, ["q_proj", "model.embed_tokens"])
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.input_layernorm \(LlamaRMSNorm\)"):
        target_linear_parameters(model, ["layernorm"])  # a substring that selects norms
    with pytest.raises(ConfigError, match=r"model\.norm \(LlamaRMSNorm\)"):
        target_linear_parameters(model, "model.norm")


def test_regex_skips_non_linear_modules_and_containers_only(model):
    # ".*layers.0.*" also matches the decoder layer, its norms and act_fn: skipped as in Trainer
    weights = target_linear_parameters(model, r"model\.layers\.0.*")
    assert len(weights) == 7
    with pytest.raises(ConfigError, match=r"selects no nn\.Linear module \(it selects only model\.layers\.0\.mlp "
                                          r"\(LlamaMLP\)\)"):
        target_linear_parameters(model, r"model\.layers\.0\.mlp")


def test_bad_regex_is_refused(model):
    with pytest.raises(ConfigError, match=r"my\.key: '\(attn' is not a valid regex"):
        target_linear_parameters(model, ["(attn"], key="my.key")


def test_tied_weight_is_named_once():
    tied = tiny_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    # lm_head's weight is listed by named_parameters as the embedding's: Trainer leaves it out
    with pytest.raises(ConfigError, match=r"selects only nn\.Linear weights tied .*\(lm_head\.weight\)"):
        target_linear_parameters(tied, ["lm_head"])


def test_an_optimizer_without_target_modules_refuses_them():
    from engine import Run

    with pytest.raises(ConfigError, match=r"^train\.optim_target_modules: adamw_torch optimizes every parameter and "
                                          r"takes no target modules \(GaLore and APOLLO names do\)"):
        Run({"train": {"optim": "adamw_torch", "optim_target_modules": ["mlp"]}})
