"""The draft forward follows docs/architecture.md ("The draft forward"), on every attention backend,
with and without cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import HIDDEN_SIZE, draft_config, make_draft, make_target, rms, rope
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from dflash_hf import DFlashDraftModel
from dflash_hf.modeling_dflash import DFlashRotaryEmbedding


def reference_forward(state, block_embeddings, features, block_positions, context_positions,
                      num_layers=2, heads=4, kv_heads=2, head_dim=16):
    """Design doc section 2, written out literally for a batch of one."""
    context = rms(features @ state["fc.weight"].T, state["hidden_norm.weight"])  # [C, H]
    h = block_embeddings
    for i in range(num_layers):
        p = lambda name, i=i: state[f"layers.{i}.{name}"]
        x = rms(h, p("input_layernorm.weight"))
        q = (x @ p("self_attn.q_proj.weight").T).view(-1, heads, head_dim)
        q = rope(rms(q, p("self_attn.q_norm.weight")).transpose(0, 1), block_positions)  # [heads, T, D]
        rows = torch.cat((context, x))  # [C + T, H]: context rows are NOT input-normalised
        k = rms((rows @ p("self_attn.k_proj.weight").T).view(-1, kv_heads, head_dim), p("self_attn.k_norm.weight"))
        v = (rows @ p("self_attn.v_proj.weight").T).view(-1, kv_heads, head_dim)
        k = rope(k.transpose(0, 1), torch.cat((context_positions, block_positions)))
        v = v.transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        attention = torch.softmax(q @ k.transpose(1, 2) * head_dim ** -0.5, -1) @ v  # non-causal
        h = h + attention.transpose(0, 1).reshape(len(h), -1) @ p("self_attn.o_proj.weight").T
        y = rms(h, p("post_attention_layernorm.weight"))
        h = h + (F.silu(y @ p("mlp.gate_proj.weight").T)
                 * (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return rms(h, state["norm.weight"])


def random_inputs(context_length=11, block_size=8, start=11, seed=0):
    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(1, block_size, HIDDEN_SIZE, generator=generator)
    features = torch.randn(1, context_length, 2 * HIDDEN_SIZE, generator=generator)
    return block, features, torch.arange(start, start + block_size)[None], torch.arange(context_length)[None]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_draft_forward_matches_the_design_doc(implementation):
    draft = make_draft(1)
    draft.config._attn_implementation = implementation
    block, features, block_positions, context_positions = random_inputs()
    with torch.no_grad():
        actual = draft(block, features, block_positions, context_positions)[0]
        expected = reference_forward(draft.state_dict(), block[0], features[0], block_positions[0],
                                     context_positions[0])
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_attn_implementation_is_selectable_at_load(tmp_path):
    make_draft(2).save_pretrained(tmp_path)
    for implementation in ("eager", "sdpa"):
        draft = DFlashDraftModel.from_pretrained(tmp_path, attn_implementation=implementation)
        assert draft.config._attn_implementation == implementation


def test_incremental_context_cache_equals_one_full_pass():
    draft = make_draft(3)
    block, features, block_positions, context_positions = random_inputs(context_length=15, start=15)
    with torch.no_grad():
        full = draft(block, features, block_positions, context_positions)
        cache = draft.new_cache()
        draft(block, features[:, :6], torch.arange(6, 14)[None], context_positions[:, :6], cache=cache)
        draft(block, features[:, 6:10], torch.arange(10, 18)[None], context_positions[:, 6:10], cache=cache)
        assert cache.get_seq_length() == 10  # context rows only: block rows are never cached
        incremental = draft(block, features[:, 10:], block_positions, context_positions[:, 10:], cache=cache)
    assert cache.get_seq_length() == 15
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attention_mask_hides_context_rows(implementation):
    """A bool mask [B, 1, T, C + T] gives each block row exactly the context it is allowed to see."""
    draft = make_draft(4)
    draft.config._attn_implementation = implementation
    block, features, block_positions, context_positions = random_inputs(context_length=12, start=5)
    mask = torch.ones(1, 1, 8, 12 + 8, dtype=torch.bool)
    mask[..., 5:12] = False  # the block starting at position 5 sees context 0..4 only
    with torch.no_grad():
        masked = draft(block, features, block_positions, context_positions, attention_mask=mask)
        truncated = draft(block, features[:, :5], block_positions, context_positions[:, :5])
    torch.testing.assert_close(masked, truncated, rtol=1e-5, atol=1e-5)


def test_llama3_rope_matches_transformers():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    llama = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
                        rope_scaling=scaling, max_position_embeddings=131072)
    expected = LlamaRotaryEmbedding(llama).inv_freq
    config = draft_config(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
                          rope_scaling=scaling, max_position_embeddings=131072)
    torch.testing.assert_close(DFlashRotaryEmbedding(config).inv_freq, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hidden_states_index_is_the_layer_output(arch):
    """Feature of layer l is hidden_states[l + 1], the output of decoder layer l
    (docs/architecture.md, "The draft forward")."""
    target = make_target(arch, seed=5)
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, idx=idx:
                                         captured.__setitem__(idx, o[0] if isinstance(o, tuple) else o))
             for idx, layer in enumerate(target.model.layers)]
    with torch.no_grad():
        hidden_states = target(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    for layer_id in range(len(target.model.layers) - 1):
        torch.testing.assert_close(hidden_states[layer_id + 1], captured[layer_id])
