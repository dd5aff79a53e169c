"""`spec_generate` follows `generate`'s conventions: settings not passed come from the generation config."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import make_draft, make_target
from transformers import GenerationConfig

from dflash_hf.settings_dflash import DECODING_MODES, DEFAULT_MAX_NEW_TOKENS, resolve_generation_choices

PROMPT = torch.tensor([[5, 9, 2, 44, 7, 3]])


@pytest.fixture
def target():
    return make_target("qwen3", seed=11)


def test_defaults_come_from_the_targets_generation_config(target):
    """No arguments: the target's max_new_tokens and every EOS id of its config, exactly as `generate` uses them."""
    continuation = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=30, do_sample=False,
                                   min_new_tokens=30)[0, PROMPT.shape[1]:].tolist()
    fresh = [i for i in range(1, 30) if continuation[i] not in continuation[:i]]  # first occurrences
    early, late = fresh[len(fresh) // 3], fresh[-1]
    target.generation_config.eos_token_id = [continuation[late], continuation[early]]  # a list, as Qwen3's is
    target.generation_config.max_new_tokens = 30
    target.generation_config.pad_token_id = 0
    expected = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT))  # generate's own defaults
    output = make_draft(11).spec_generate(target=target, input_ids=PROMPT)
    assert torch.equal(output, expected)
    assert output.shape[1] == PROMPT.shape[1] + early + 1  # stopped at the second EOS id, the earlier one


def test_explicit_arguments_override_the_config(target):
    target.generation_config.update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, eos_token_id=[7, 8])
    sampled = resolve_generation_choices(target, prompt_length=6)
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.stop_token_ids) == (0.6, 20, 0.95, [7, 8])
    assert resolve_generation_choices(target, 6, temperature=0.0).temperature == 0.0  # temperature 0 is greedy
    assert resolve_generation_choices(target, 6, do_sample=False).temperature == 0.0
    assert resolve_generation_choices(target, 6, temperature=1.3).temperature == 1.3
    assert resolve_generation_choices(target, 6, stop_token_ids=[]).stop_token_ids == []
    assert resolve_generation_choices(target, 6, stop_token_ids=3).stop_token_ids == [3]
    assert resolve_generation_choices(target, 6, top_k=0, top_p=1.0).top_k is None  # generate's "no filter"
    passed = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=4, pad_token_id=9)
    choices = resolve_generation_choices(target, 6, passed)
    assert (choices.max_new_tokens, choices.temperature, choices.stop_token_ids,
            choices.pad_token_id) == (12, 0.0, [4], 9)


def test_greedy_override_of_a_sampling_config_stays_lossless(target):
    target.generation_config.update(do_sample=True, temperature=0.9, top_k=5)
    expected = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=16, do_sample=False)
    output = make_draft(12).spec_generate(target=target, input_ids=PROMPT, max_new_tokens=16, temperature=0.0)
    assert torch.equal(output, expected)


def test_length_default_is_the_one_documented_difference(target):
    """generate's library default is max_length 20 (prompt included); spec_generate generates 256 new tokens."""
    assert resolve_generation_choices(target, 6, GenerationConfig()).max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert resolve_generation_choices(target, 6, GenerationConfig(max_length=40)).max_new_tokens == 34


@pytest.mark.parametrize("setting", [{"num_beams": 3}, {"guidance_scale": 1.5}])
def test_a_decoding_mode_is_refused_from_the_call_the_passed_config_and_the_targets(target, setting):
    draft = make_draft(13)
    with pytest.raises(ValueError, match=f"the call sets {next(iter(setting))}="):
        draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=4, **setting)
    with pytest.raises(ValueError, match="the generation config sets"):
        draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=4,
                            generation_config=GenerationConfig(**setting))
    target.generation_config.update(**setting)
    with pytest.raises(ValueError, match="target.generation_config sets"):
        draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=4)


@pytest.mark.parametrize("setting", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}])
def test_a_processor_of_the_targets_config_or_a_passed_config_is_applied_as_generate_applies_it(target, setting):
    """A processor set in a generation config (the target's, or one passed) is applied as `generate` applies it."""
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    plain = target.generate(attention_mask=torch.ones_like(PROMPT), **kwargs)
    passed = GenerationConfig(**setting, do_sample=False)
    expected = target.generate(attention_mask=torch.ones_like(PROMPT), generation_config=passed, max_new_tokens=16,
                               input_ids=PROMPT, pad_token_id=0)
    assert not torch.equal(expected, plain)  # the processor changes the output
    assert torch.equal(make_draft(13).spec_generate(target=target, generation_config=passed, **kwargs), expected)
    target.generation_config.update(**setting)
    assert torch.equal(make_draft(13).spec_generate(target=target, **kwargs), expected)


MODE_VALUES = {"num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 0.5, "num_return_sequences": 2,
               "penalty_alpha": 0.6, "dola_layers": "low", "guidance_scale": 1.5,
               "watermarking_config": {"greenlist_ratio": 0.25}, "prompt_lookup_num_tokens": 3}


@pytest.mark.parametrize("name", sorted(DECODING_MODES))
def test_each_decoding_mode_is_refused_by_name_before_any_forward(target, name, monkeypatch):
    """Beam search, contrastive search, DoLa, guidance, watermarking, ...: the message names the method, why it does
    not run inside speculative decoding and the alternative; the target never ran."""
    calls = []
    monkeypatch.setattr(type(target), "forward", lambda *args, **kwargs: calls.append(1))
    mode, reason = DECODING_MODES[name]
    with pytest.raises(ValueError, match=re.escape(f"{mode} does not run inside DFlash speculative decoding "
                                                   f"({reason})")):
        make_draft(13).spec_generate(target=target, input_ids=PROMPT, max_new_tokens=4, **{name: MODE_VALUES[name]})
    assert calls == []


def test_the_call_overrides_a_setting_of_the_config_that_the_loop_cannot_honour(target):
    target.generation_config.repetition_penalty = 1.2  # as some Instruct models ship
    expected = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=12, do_sample=False,
                               repetition_penalty=1.0)
    output = make_draft(14).spec_generate(target=target, input_ids=PROMPT, max_new_tokens=12, repetition_penalty=1.0)
    assert torch.equal(output, expected)


def test_lengths_and_unknown_settings(target):
    assert resolve_generation_choices(target, 6, max_length=40).max_new_tokens == 34
    assert resolve_generation_choices(target, 6, max_length=40, max_new_tokens=5).max_new_tokens == 5
    with pytest.raises(ValueError, match="the generation config sets max_length=4, which leaves no room"):
        resolve_generation_choices(target, 6, GenerationConfig(max_length=4))
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) token_healing"):
        resolve_generation_choices(target, 6, token_healing=True)


def test_lengths_and_unset_fields_of_a_passed_config_follow_generate(target):
    """As `generate`: max_new_tokens (from the call or a config) wins over max_length; a passed config's unset
    fields come from the target's config (here its pad id, so a left-padded batch without a mask is masked); a
    max_length a config sets explicitly counts, except where Transformers cannot tell it from its default."""
    draft = make_draft(11)
    arguments = dict(attention_mask=torch.ones_like(PROMPT), max_length=PROMPT.shape[1] + 20, pad_token_id=0,
                     generation_config=GenerationConfig(max_new_tokens=5, do_sample=False))
    expected = target.generate(PROMPT, **arguments)
    assert expected.shape[1] == PROMPT.shape[1] + 5
    assert torch.equal(draft.spec_generate(target=target, input_ids=PROMPT, **arguments), expected)
    target.generation_config.pad_token_id = 1
    batch = torch.tensor([[1, 1, 5, 9, 2], [44, 7, 3, 6, 8]])  # row 0 left-padded with the target's pad id
    config = GenerationConfig(max_new_tokens=6, do_sample=False)  # no pad id: the target's
    expected = target.generate(batch, generation_config=config)
    assert not torch.equal(expected, target.generate(batch, attention_mask=torch.ones_like(batch),
                                                     generation_config=config))  # the mask matters here
    assert torch.equal(draft.spec_generate(target=target, input_ids=batch, generation_config=config), expected)
    explicit_default = GenerationConfig().max_length is None  # Transformers 5: an explicit max_length of 20 counts
    config = GenerationConfig(max_length=20 if explicit_default else PROMPT.shape[1] + 13, do_sample=False)
    new_tokens = draft.spec_generate(target=target, input_ids=PROMPT, generation_config=config,
                                     attention_mask=torch.ones_like(PROMPT)).shape[1] - PROMPT.shape[1]
    assert new_tokens == config.max_length - PROMPT.shape[1]
    called = draft.spec_generate(target=target, input_ids=PROMPT, max_length=20,
                                 attention_mask=torch.ones_like(PROMPT))
    assert called.shape[1] == 20  # a max_length the call passes counts, whatever its value
