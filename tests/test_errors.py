"""Bad input raises a clear error naming the problem; nothing silent."""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft, plain_greedy
from transformers import Qwen3Config, Qwen3Model

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.mark.parametrize("draft_kwargs,message", [
    ({"hidden_size": 32, "head_dim": 8}, "hidden_size 32 does not match"),
    ({"vocab_size": 100, "mask_token_id": 5}, "vocab_size 100 does not match"),
    ({"dflash_config": {"mask_token_id": 127, "target_layer_ids": [1, 6]}}, r"target_layer_ids \[6\] are outside"),
    ({"num_target_layers": 36}, "trained for a target with 36 layers"),
    ({"mask_token_id": 500}, "mask_token_id 500 is outside"),
])
def test_draft_target_mismatch(target, draft_kwargs, message):
    draft = make_draft(0, **draft_kwargs)
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=4)


def test_spec_generate_takes_every_setting_by_keyword(target):
    """A setting passed by position (once `max_new_tokens`, now keyword-only) is a TypeError, not another setting."""
    draft = make_draft(0)
    with pytest.raises(TypeError, match="positional"):
        draft.spec_generate(target, PROMPT, 4)
    assert draft.spec_generate(target, PROMPT, max_new_tokens=4).shape == (1, PROMPT.shape[1] + 4)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"input_ids": torch.zeros((1, 0), dtype=torch.long)}, ValueError, "prompt is empty"),
    ({"attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}, ValueError, "pads row 0 on the right"),
    ({"attention_mask": torch.tensor([[0, 0, 0, 0, 0]])}, ValueError, "prompt of row 0 is empty"),
    ({"attention_mask": torch.tensor([[1, 1, 1]])}, ValueError, "attention_mask has shape"),
    ({"attention_mask": torch.tensor([[2, 1, 1, 1, 1]])}, ValueError, "only 0"),
    ({"input_ids": PROMPT[:0]}, ValueError, "batch is empty"),
    ({"streamer": object()}, TypeError, "lacks put"),
    ({"streamer": [None, None]}, ValueError, "2 streamer"),
    ({"temperature": 1.0, "generator": [torch.Generator()] * 3}, ValueError, "3 generators for a batch of 1"),
    ({"input_ids": PROMPT[0]}, ValueError, "shape"),
    ({"input_ids": PROMPT.float()}, TypeError, "integer"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": -3}, ValueError, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": 252}, ValueError, "exceeds the target's position limit"),
    ({"block_size": 0}, ValueError, "block_size must be an integer from 1"),
    ({"block_size": 9}, ValueError, "trained size 8"),
    ({"temperature": -0.5}, ValueError, "temperature"),
    ({"temperature": 1.0, "top_p": 1.5}, ValueError, "top_p"),
    ({"temperature": 1.0, "top_k": -1}, ValueError, "top_k"),
    ({"num_beams": 4}, ValueError, "num_beams=4: beam search does not run"),
    ({"repetition_penalty": -1.0}, ValueError, "penalty` has to be a strictly positive float"),
    ({"stop_strings": ["ab"]}, ValueError, "stop_strings needs the target's tokenizer: pass tokenizer="),
    ({"max_new_tokenz": 4}, TypeError, "unexpected keyword argument\\(s\\) max_new_tokenz"),
    ({"input_ids": torch.tensor([[3, 1, 400]])}, ValueError, "token id 400, outside the target's vocabulary"),
    ({"input_ids": torch.tensor([[3, -1, 4]])}, ValueError, "token id -1, outside the target's vocabulary"),
    ({"temperature": 1.0, "top_k": 5.5}, TypeError, "top_k must be an integer"),
    ({"temperature": "0.5"}, TypeError, "temperature must be a number, got '0.5'"),
    ({"temperature": 1.0, "generator": 42}, TypeError, "pass seed=42 instead"),
    ({"target": None}, TypeError, "target must be a Transformers causal LM"),
    ({"attention_mask": [[1, 1, 1, 1, 1]]}, TypeError, "attention_mask must be a torch.Tensor"),
    ({"attention_mask": torch.tensor([[0.5, 1, 1, 1, 1]])}, ValueError, "only 0"),
    ({"forced_eos_token_id": 7, "suppress_tokens": [7, 9]}, ValueError,
     r"Every token of forced_eos_token_id \(\[7\]\) is also in suppress_tokens"),
    ({"forced_bos_token_id": 7, "suppress_tokens": [7]}, ValueError, "forced_bos_token_id .* also in suppress_tokens"),
    ({"forced_eos_token_id": 400}, ValueError, r"forced_eos_token_id 400 is outside the target's vocabulary \(0 to"),
    ({"exponential_decay_length_penalty": (2, 1.5)}, ValueError, "exponential_decay_length_penalty.* no eos_token_id"),
])
def test_bad_generation_arguments(target, draft, kwargs, error, message):
    arguments = {"target": target, "input_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        draft.spec_generate(**arguments)


def test_draft_position_limit(target):
    draft = make_draft(0, max_position_embeddings=16)
    with pytest.raises(ValueError, match="draft's max_position_embeddings=16"):
        draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=12)


def test_draft_and_target_on_different_devices(target):
    draft = make_draft(0).to("meta")
    with pytest.raises(ValueError, match="Draft is on meta but the target's embedding computes on cpu"):
        draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=4)


def test_target_without_lm_head(draft):
    base = Qwen3Model(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="no input embedding or LM head"):
        draft.spec_generate(target=base, input_ids=PROMPT, max_new_tokens=4)


def test_full_attention_mask_is_accepted(target, draft):
    out = draft.spec_generate(target=target, input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT),
                              max_new_tokens=6)
    assert torch.equal(out, plain_greedy(target, PROMPT, 6))


def test_mixed_float_dtypes_are_cast_and_stay_lossless(target):
    draft = make_draft(0).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="draft is torch.bfloat16 but the target is torch.float32"):
        out = draft.spec_generate(target=target, input_ids=PROMPT, max_new_tokens=20)
    assert torch.equal(out, plain_greedy(target, PROMPT, 20))


def test_a_batch_on_a_target_with_an_attention_indexer_cache_is_refused(target):
    """Compaction moves keys and values but not an indexer's own keys (DeepSeek-V3.2-style caches): one row only."""
    from transformers import DynamicCache

    from dflash_hf.support_dflash import check_cache

    class IndexedLayer:  # what such a cache layer has besides keys and values
        indexer_keys = torch.zeros(0)

    cache = DynamicCache()
    cache.layers = [IndexedLayer()]
    with pytest.raises(ValueError, match=r"attention indexer cache \(IndexedLayer\).*pass one row"):
        check_cache(cache, target, num_rows=2)
    check_cache(cache, target, num_rows=1)  # a single row is fine


def test_a_config_without_a_cache_layout_gives_no_cache_and_other_errors_are_not_hidden():
    """`config_cache` returns None only where Transformers cannot lay a cache out from the config (the model then makes
    its own); a bug elsewhere still raises."""
    from transformers import PretrainedConfig

    from dflash_hf.support_dflash import config_cache

    assert len(config_cache(Qwen3Config(num_hidden_layers=3)).layers) == 3
    assert config_cache(PretrainedConfig()) is None  # no `num_hidden_layers`

    class Broken(PretrainedConfig):
        def get_text_config(self, *args, **kwargs):
            raise RuntimeError("a bug in the config class")

    with pytest.raises(RuntimeError, match="a bug in the config class"):
        config_cache(Broken())
