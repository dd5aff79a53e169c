"""A draft initialised from the target starts as the target's top layer reading the target's deepest feature."""

from __future__ import annotations

import torch
from helpers import TARGET_LAYERS, VOCAB_SIZE, make_target

from dflash_hf import DFlashDraftModel
from dflash_hf.training.recipe import draft_config_for, initialize_from_target, source_layer_ids


def test_initialised_one_layer_draft_reproduces_the_targets_last_layer():
    target = make_target("qwen3", seed=4)
    draft = DFlashDraftModel(draft_config_for(target, 1, 4, VOCAB_SIZE - 1, [TARGET_LAYERS - 2])).eval()
    ids = torch.randint(3, VOCAB_SIZE - 1, (20,), generator=torch.Generator().manual_seed(0))
    assert initialize_from_target(draft, target, ids) == [TARGET_LAYERS - 1]
    with torch.no_grad():
        outputs = target(ids[None], output_hidden_states=True)
        before_last = outputs.hidden_states[TARGET_LAYERS - 1]  # output of layer N-2: the last layer's input
        for position in (1, 9, 19):
            # a one-row block holding the target's own residual at `position`, context = features before it
            hidden = draft(before_last[:, position : position + 1], before_last[:, :position],
                           torch.tensor([[position]]), torch.arange(position)[None])
            logits = target.get_output_embeddings()(hidden[0, 0])
            torch.testing.assert_close(logits, outputs.logits[0, position], atol=1e-4, rtol=1e-4)


def test_llama_targets_get_query_key_norms_at_their_scale():
    target = make_target("llama", seed=5)
    draft = DFlashDraftModel(draft_config_for(target, 2, 4, VOCAB_SIZE - 1))
    copied = initialize_from_target(draft, target, torch.arange(3, 40))
    assert copied == source_layer_ids(target, draft) == [TARGET_LAYERS - 2, TARGET_LAYERS - 1]
    for draft_layer, layer_id in zip(draft.layers, copied, strict=True):
        source = target.model.layers[layer_id]
        assert torch.equal(draft_layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
        assert torch.equal(draft_layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        q_norm = draft_layer.self_attn.q_norm.weight
        q_norm = q_norm.detach()
        assert torch.all(q_norm == q_norm[0]) and 0 < float(q_norm[0]) != 1.0  # one measured RMS, not the default
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
