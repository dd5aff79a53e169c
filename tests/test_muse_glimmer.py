"""Transformers' native DFlash draft (`muse_glimmer_assistant`, Meta's MuseGlimmer assistant) built and initialised by
its own class, saved, and run by `spec_generate`: the same proposals as Transformers' assisted decoding, and output
equal to plain greedy in batches, in trees and on a hybrid target."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    HIDDEN_SIZE,
    VOCAB_SIZE,
    RecordingProposer,
    left_pad_prompts,
    make_hybrid_target,
    make_target,
    plain_greedy,
    prompts_of,
)
from test_conversion import native_generate

from dflash_hf import DFlashDraftModel, speculative_decode
from dflash_hf.configuration_dflash import layer_attention

try:
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
except ImportError:  # Transformers < 5.24 has no native DFlash draft (its folders still load: test_conversion.py)
    pytest.skip("the installed Transformers has no MuseGlimmerAssistantModel", allow_module_level=True)

BLOCK_SIZE = 8
# every layer sliding (the class's default), window 6: prompts of 23 tokens reach past it
KINDS = {"sliding": dict(sliding_window=6), "mixed": dict(layer_types=["sliding_attention", "full_attention"],
                                                         sliding_window=4)}


def native_folder(tmp_path, kind: str = "sliding", seed: int = 0):
    """A tiny MuseGlimmer assistant from its own class and init (weights then spread, so that its proposals vary),
    saved as Transformers saves it; returns (the native model, its folder)."""
    config = MuseGlimmerAssistantConfig(
        hidden_size=HIDDEN_SIZE, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, block_size=BLOCK_SIZE,
        mask_token_id=VOCAB_SIZE - 1, target_layer_ids=[0, 2], rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6},
        **KINDS[kind])
    torch.manual_seed(seed)
    native = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():
        for parameter in native.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    native.save_pretrained(tmp_path / "native")
    return native, tmp_path / "native"


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_native_draft_proposes_as_transformers_assisted_decoding_does(tmp_path, monkeypatch, kind):
    target = make_target("qwen3", seed=7)
    native, folder = native_folder(tmp_path, kind)
    draft = DFlashDraftModel.from_pretrained(folder)
    assert draft.config.block_size == BLOCK_SIZE and draft.config.dflash_config["target_layer_ids"] == [0, 2]
    # bidirectional layers; the native window W is inclusive (|q - k| <= W), ours exclusive: W + 1
    window = KINDS[kind]["sliding_window"]
    assert [layer_attention(draft.config, i) for i in range(2)] == [
        (False, window + 1 if layer_type == "sliding_attention" else None) for layer_type in native.config.layer_types]
    for seed, length in ((0, 1), (1, 23)):
        input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, length), generator=torch.Generator().manual_seed(seed))
        expected = plain_greedy(target, input_ids, 30)
        output, native_drafted = native_generate(target, native, input_ids, 30, monkeypatch)
        assert torch.equal(output, expected)
        proposer = RecordingProposer(draft, target, VOCAB_SIZE - 1)
        assert torch.equal(speculative_decode(target, proposer, input_ids, max_new_tokens=30,
                                              block_size=BLOCK_SIZE).output_ids, expected)
        # both loops draft full blocks until ours shortens its last ones to what is still needed: there, the same
        full_blocks = [proposals for proposals in proposer.proposed[0] if len(proposals) == BLOCK_SIZE - 1]
        assert len(full_blocks) >= 3 and native_drafted[: len(full_blocks)] == full_blocks


def test_on_a_muse_glimmer_target_the_proposals_are_transformers_own(tmp_path, monkeypatch):
    """Meta's target for these drafts: its embedding module normalises (`embed_norm`), which Transformers' loop
    bypasses; the draft's raw lookup of the same table gives the same proposals. Its logits' multiplier and softcap are
    the target's own, not the draft's."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(4)
    target = MuseGlimmerForConditionalGeneration(MuseGlimmerConfig(text_config=dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=0))).eval()
    target.generation_config.eos_token_id = None
    assert getattr(target.get_input_embeddings(), "embed_norm", None) is not None
    native, folder = native_folder(tmp_path, "sliding", seed=3)
    draft = DFlashDraftModel.from_pretrained(folder)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 23), generator=torch.Generator().manual_seed(5))
    expected = plain_greedy(target, input_ids, 24)
    output, native_drafted = native_generate(target, native, input_ids, 24, monkeypatch)
    assert torch.equal(output, expected)
    proposer = RecordingProposer(draft, target, VOCAB_SIZE - 1)
    assert torch.equal(speculative_decode(target, proposer, input_ids, max_new_tokens=24,
                                          block_size=BLOCK_SIZE).output_ids, expected)
    full_blocks = [proposals for proposals in proposer.proposed[0] if len(proposals) == BLOCK_SIZE - 1]
    assert len(full_blocks) >= 3 and native_drafted[: len(full_blocks)] == full_blocks


def test_a_native_draft_decodes_a_left_padded_batch_and_trees_like_plain_greedy(tmp_path):
    target = make_target("llama", seed=5)
    _, folder = native_folder(tmp_path, "mixed", seed=1)
    draft = DFlashDraftModel.from_pretrained(folder)
    prompts = prompts_of([1, 23, 9], seed=2)
    input_ids, attention_mask = left_pad_prompts(prompts)
    expected = [plain_greedy(target, prompt, 30)[0, prompt.shape[1]:].tolist() for prompt in prompts]
    for tree_size in (None, 8):
        result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=30, tree_size=tree_size, return_stats=True)
        assert [result.new_tokens(row) for row in range(3)] == expected, tree_size


def test_a_native_draft_on_a_hybrid_target_equals_plain_greedy(tmp_path):
    target = make_hybrid_target("qwen3_5", seed=3)
    _, folder = native_folder(tmp_path, "sliding", seed=2)
    draft = DFlashDraftModel.from_pretrained(folder)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 13), generator=torch.Generator().manual_seed(1))
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=24),
                       plain_greedy(target, input_ids, 24))
