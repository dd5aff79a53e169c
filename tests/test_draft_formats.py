"""Every draft format of docs/formats.md: sliding / causal layers, scaled embeddings and logits, DFlash2.

Masks are checked cell by cell against the doc's rules written out literally; the forward against a literal
single-row implementation; decoding against the target's own greedy decode (and sampling against its distribution).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DRAFT_VARIANTS,
    HIDDEN_SIZE,
    VOCAB_SIZE,
    make_target,
    make_variant_draft,
    plain_greedy,
    random_prompt,
    rms,
    rope,
)
from safetensors.torch import load_file
from sampling_checks import NUM_NEW, NUM_SAMPLES, assert_follows, exact_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB

from dflash_hf import DFlashDraftModel, DraftStep, left_pad
from dflash_hf.modeling_dflash import DFlash2DraftModel, layer_attention_mask
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.target_dflash import select_features
from dflash_hf.training.objective import build_blocks, dflash_loss

ARCHS = ["qwen3", "llama"]
VARIANTS = list(DRAFT_VARIANTS)


# --- Masks: the doc's rules, literally ---------------------------------------------------------------------------


def literal_mask(context_length: int, block_length: int, causal: bool, window: int | None) -> torch.Tensor:
    """docs/formats.md: keys are [context ; block] slots, queries the block slots at the tail of that axis."""
    mask = torch.zeros(block_length, context_length + block_length, dtype=torch.bool)
    for i in range(block_length):
        qpos = context_length + i
        for kpos in range(context_length + block_length):
            allowed = kpos <= qpos if causal else True
            if window is not None:
                allowed = allowed and qpos - kpos < window
                if not causal:
                    allowed = allowed and kpos - qpos < window
            mask[i, kpos] = allowed
    return mask


KINDS = [(False, None), (True, None), (True, 1), (True, 3), (True, 8), (True, 20), (False, 1), (False, 3), (False, 20)]


@pytest.mark.parametrize("causal,window", KINDS)
@pytest.mark.parametrize("context_length", [0, 2, 9])
def test_layer_masks_equal_the_literal_rules_cell_by_cell(causal, window, context_length):
    block_length = 6
    positions = torch.arange(context_length + block_length)[None]  # the cache holds every earlier position
    mask = layer_attention_mask(None, positions[:, context_length:], positions, causal, window)
    expected = literal_mask(context_length, block_length, causal, window)
    if mask is None:
        assert expected.all()
    else:
        assert torch.equal(mask[0, 0], expected)


def test_window_at_the_context_block_boundary():
    """Window 3, context 9: the block's first query sees context slots 7 and 8 and itself; a non-causal one also
    the next two block slots; the last block query sees no context at all."""
    positions = torch.arange(15)[None]
    causal = layer_attention_mask(None, positions[:, 9:], positions, True, 3)[0, 0]
    bidirectional = layer_attention_mask(None, positions[:, 9:], positions, False, 3)[0, 0]
    assert causal[0].nonzero().flatten().tolist() == [7, 8, 9]
    assert bidirectional[0].nonzero().flatten().tolist() == [7, 8, 9, 10, 11]
    assert causal[5].nonzero().flatten().tolist() == [12, 13, 14]
    assert not bidirectional[5, :9].any()


def test_layer_masks_keep_the_batch_mask_and_follow_positions_not_columns():
    """A row whose cache has a hole (an unused column) gets the mask its positions give, and the hole stays hidden."""
    # columns: positions 0 1 2 [hole] 3 4 | block 5 6 7
    key_positions = torch.tensor([[0, 1, 2, 99, 3, 4, 5, 6, 7]])
    base = torch.tensor([[True, True, True, False, True, True, True, True, True]])[:, None, None, :]
    mask = layer_attention_mask(base, key_positions[:, 6:], key_positions, True, 3)[0, 0]
    compact = literal_mask(5, 3, True, 3)
    assert torch.equal(mask[:, [0, 1, 2, 4, 5, 6, 7, 8]], compact)
    assert not mask[:, 3].any()
    additive = torch.zeros(base.shape).masked_fill(~base, torch.finfo(torch.float32).min)
    assert torch.equal(layer_attention_mask(additive, key_positions[:, 6:], key_positions, True, 3)[0, 0], mask)


def test_layer_kinds_follow_layer_types_and_is_causal():
    """Absent `is_causal`: sliding layers causal, full layers bidirectional; present: every layer."""
    kinds = lambda variant: [layer.attention_kind for layer in make_variant_draft(variant).layers]  # noqa: E731
    assert kinds("sliding_mixed") == [(True, 5), (False, None)]
    assert kinds("all_causal") == [(True, None), (True, None)]
    assert kinds("sliding_bidirectional") == [(False, 3), (False, 3)]
    assert kinds("scaled") == [(False, None), (False, None)]


# --- The forward, literally ----------------------------------------------------------------------------------------


def literal_convolution(x, dynamic, base, group_size):
    """docs/formats.md `conv`: x [T, H], dynamic [T, k, H/g], base [k, H]; causal within x."""
    length, hidden = x.shape
    groups = hidden // group_size
    rows = x.view(length, groups, group_size)
    output = torch.zeros_like(rows)
    for t in range(length):
        for offset in range(base.shape[0]):
            if t - offset >= 0:
                output[t] += base[offset].view(groups, group_size) * rows[t - offset]
                output[t] += dynamic[t, offset][:, None] * rows[t - offset]
    return output.view(length, hidden)


def literal_prepare(state, prefix, x, kernel_size, group_size):
    kernels = (x @ state[prefix + "kernel_projection.weight"].T).view(len(x), 2, kernel_size, -1)
    base = state[prefix + "base_kernel"]
    return literal_convolution(x, kernels[:, 0], base[0], group_size), (kernels[:, 1], base[1])


def literal_forward(draft, block_embeddings, features, block_positions, context_positions):
    """One row: docs/architecture.md's draft forward plus the per-layer masks and DFlash2 convolutions
    of docs/formats.md."""
    config, state = draft.config, draft.state_dict()
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    k, g = getattr(config, "conv_kernel_size", None), getattr(config, "conv_group_size", None)
    dflash2 = isinstance(draft, DFlash2DraftModel)
    context = rms(features @ state["fc.weight"].T, state["hidden_norm.weight"])
    h = block_embeddings
    for i in range(config.num_hidden_layers):
        p = lambda name, i=i: state[f"layers.{i}.{name}"]
        sliding = config.layer_types[i] == "sliding_attention"
        causal = sliding if config.is_causal is None else config.is_causal
        mask = literal_mask(len(context), len(h), causal, config.sliding_window if sliding else None)
        x = rms(h, p("input_layernorm.weight"))
        if dflash2:
            x, (kernel, base) = literal_prepare(state, f"layers.{i}.attention_conv.", x, k, g)
        q = (x @ p("self_attn.q_proj.weight").T).view(-1, heads, head_dim)
        q = rope(rms(q, p("self_attn.q_norm.weight")).transpose(0, 1), block_positions)
        rows = torch.cat((context, x))
        keys = rms((rows @ p("self_attn.k_proj.weight").T).view(-1, kv_heads, head_dim), p("self_attn.k_norm.weight"))
        keys = rope(keys.transpose(0, 1), torch.cat((context_positions, block_positions)))
        values = (rows @ p("self_attn.v_proj.weight").T).view(-1, kv_heads, head_dim).transpose(0, 1)
        keys, values = keys.repeat_interleave(heads // kv_heads, 0), values.repeat_interleave(heads // kv_heads, 0)
        scores = (q @ keys.transpose(1, 2) * head_dim ** -0.5).masked_fill(~mask, float("-inf"))
        attended = ((torch.softmax(scores, -1) @ values).transpose(0, 1).reshape(len(h), -1)
                    @ p("self_attn.o_proj.weight").T)
        h = h + (literal_convolution(attended, kernel, base, g) if dflash2 else attended)
        y = rms(h, p("post_attention_layernorm.weight"))
        if dflash2:
            y, (kernel, base) = literal_prepare(state, f"layers.{i}.mlp_conv.", y, k, g)
        mlp = (F.silu(y @ p("mlp.gate_proj.weight").T) * (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        h = h + (literal_convolution(mlp, kernel, base, g) if dflash2 else mlp)
    return rms(h, state["norm.weight"])


def random_inputs(context_length=11, block_length=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(1, block_length, HIDDEN_SIZE, generator=generator)
    features = torch.randn(1, context_length, 2 * HIDDEN_SIZE, generator=generator)
    block_positions = torch.arange(context_length, context_length + block_length)[None]
    return block, features, block_positions, torch.arange(context_length)[None]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_equals_the_literal_implementation(variant, implementation):
    draft = make_variant_draft(variant, seed=1)
    draft.config._attn_implementation = implementation
    block, features, block_positions, context_positions = random_inputs()
    with torch.no_grad():
        actual = draft(block, features, block_positions, context_positions)[0]
        expected = literal_forward(draft, block[0], features[0], block_positions[0], context_positions[0])
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["sliding_mixed", "all_causal", "sliding_bidirectional", "dflash2"])
def test_incremental_context_cache_equals_one_full_pass(variant):
    draft = make_variant_draft(variant, seed=3)
    block, features, block_positions, context_positions = random_inputs(context_length=15)
    with torch.no_grad():
        full = draft(block, features, block_positions, context_positions)
        cache = draft.new_cache()
        for start, stop in ((0, 6), (6, 10), (10, 15)):
            incremental = draft(block, features[:, start:stop], torch.arange(stop, stop + 8)[None],
                                context_positions[:, start:stop], cache=cache)
    assert torch.equal(cache.positions, context_positions)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


# --- Embeddings and logits -------------------------------------------------------------------------------------------


def test_block_embeddings_are_the_raw_lookup_times_the_scale():
    """Gemma's embedding module multiplies by sqrt(hidden) itself: the draft must use the weight, not the module."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16))
    embedding = gemma.get_input_embeddings()
    ids = torch.tensor([[3, 7, 127]])
    draft = make_variant_draft("scaled")
    expected = F.embedding(ids, embedding.weight) * 8.0
    torch.testing.assert_close(draft.embed_block(ids, embedding.weight), expected)
    assert not torch.allclose(embedding(ids) * 8.0, expected)  # the module scales: using it would be wrong


def test_logits_are_multiplied_then_soft_capped():
    draft = make_variant_draft("scaled")
    logits = torch.linspace(-30, 30, 61)
    expected = torch.tanh(logits * 0.5 / 3.0) * 3.0
    torch.testing.assert_close(draft.scale_logits(logits), expected)
    assert draft.scale_logits(logits).abs().max() < 3.0
    plain = make_variant_draft("sliding_mixed")
    assert torch.equal(plain.scale_logits(logits), logits)


# --- Decoding: identical to the target's own greedy decode ---------------------------------------------------------



@pytest.fixture(scope="module")
def targets():
    return {arch: make_target(arch, seed=7) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_output_equals_plain_greedy(targets, arch, variant):
    target = targets[arch]
    for seed, prompt_length in ((0, 1), (1, 9), (2, 23)):
        draft = make_variant_draft(variant, seed=seed)
        input_ids = random_prompt(500 + seed, prompt_length)
        expected = plain_greedy(target, input_ids, max_new_tokens=30)
        for block_size in (2, 4, 8):
            result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=block_size,
                                         return_stats=True)
            assert torch.equal(result.output_ids, expected), f"seed {seed}, length {prompt_length}, block {block_size}"
            assert sum(result.acceptance_lengths[0]) == 29


@pytest.mark.parametrize("variant", VARIANTS)
def test_stop_tokens_and_batches_equal_plain_greedy(targets, variant):
    target, draft = targets["qwen3"], make_variant_draft(variant, seed=4)
    input_ids = random_prompt(500 + 4, 6)
    generated = plain_greedy(target, input_ids, max_new_tokens=30)[0, 6:].tolist()
    for stop_index in (2, 9):
        stop_token = generated[stop_index]
        expected = plain_greedy(target, input_ids, max_new_tokens=30, stop_token_ids=[stop_token])
        actual = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=8,
                                     stop_token_ids=[stop_token])
        assert actual[0].tolist() == expected[0].tolist()
    prompts = [random_prompt(500 + 5, 1), random_prompt(500 + 6, 9), random_prompt(500 + 7, 23)]
    batch, attention_mask = left_pad([row[0].tolist() for row in prompts], pad_token_id=0)
    result = draft.spec_generate(target=target, input_ids=batch, attention_mask=attention_mask, max_new_tokens=25,
                                 block_size=6, return_stats=True)
    for row, row_prompt in enumerate(prompts):
        assert result.new_tokens(row) == plain_greedy(target, row_prompt, 25)[0, row_prompt.shape[1]:].tolist()


# --- DFlash2: published key names, the selector's path, sampling ---------------------------------------------------


def test_dflash2_saves_and_loads_the_published_key_names(tmp_path):
    draft = make_variant_draft("dflash2", seed=2)
    draft.save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
            "layers.1.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
            "layers.0.mlp_conv.kernel_projection.weight"} <= keys
    assert not any(key.endswith("codebook.weight") for key in keys)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert type(loaded) is DFlash2DraftModel
    assert all(torch.equal(value, loaded.state_dict()[name]) for name, value in draft.state_dict().items())
    assert loaded.layers[0].attention_conv.kernel_size == 3 and loaded.candidate_selector.top_k == 4


def literal_selector_path(selector, logits, hidden, anchor):
    """docs/formats.md's walk for one row: logits [P, V], hidden [P, H]."""
    state = {name: value for name, value in selector.state_dict().items()}
    unary, candidates = logits.topk(selector.top_k, dim=-1)
    projected = hidden @ state["hidden_projection.weight"].T
    predecessor, path = anchor, []
    for position in range(len(logits)):
        query = state["predecessor_codebook"][predecessor] * projected[position]
        score = unary[position] + torch.einsum("r,kr->k", query, state["successor_codebook"][candidates[position]])
        predecessor = int(candidates[position, score.argmax()])
        path.append(predecessor)
    return path


def test_dflash2_greedy_proposals_are_the_selectors_path(targets):
    target, draft = targets["llama"], make_variant_draft("dflash2", seed=5)
    sequence = random_prompt(500 + 8, 12)[0].tolist()
    with torch.no_grad():
        for codebook in (draft.candidate_selector.predecessor_codebook, draft.candidate_selector.successor_codebook):
            codebook.mul_(10.0)  # pair scores comparable to the logits' gaps, so the path differs from the argmax
        features = select_features(target(torch.tensor([sequence]), output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        step = DraftStep(prompts=[sequence[:10]], generated=[sequence[10:]], target_hidden=features[:, :11],
                         context_position_ids=torch.arange(11)[None], context_valid=None, block_size=8, row_ids=[0])
        proposals = DFlashProposer(draft, target, VOCAB_SIZE - 1).propose(step)
        block_ids = torch.tensor([[sequence[-1]] + [VOCAB_SIZE - 1] * 7])
        hidden = draft(draft.embed_block(block_ids, target.get_input_embeddings().weight), features[:, :11],
                       torch.arange(11, 19)[None], torch.arange(11)[None])[0, 1:]
        logits = draft.scale_logits(target.lm_head(hidden))
        expected = literal_selector_path(draft.candidate_selector, logits, hidden, sequence[-1])
        argmax = logits.argmax(-1).tolist()
    assert proposals[0].tolist() == expected
    assert expected != argmax  # the selector changed the path: the test tells the two apart


def test_dflash2_sampled_proposals_come_from_the_candidates(targets):
    target, draft = targets["qwen3"], make_variant_draft("dflash2", seed=6)
    sequence = random_prompt(500 + 9, 10)[0].tolist()
    with torch.no_grad():
        features = select_features(target(torch.tensor([sequence]), output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        step = DraftStep(prompts=[sequence[:9]], generated=[sequence[9:]], target_hidden=features[:, :9],
                         context_position_ids=torch.arange(9)[None], context_valid=None, block_size=6, row_ids=[0],
                         temperature=1.0, generators=(torch.Generator().manual_seed(0),))
        proposal = DFlashProposer(draft, target, VOCAB_SIZE - 1).propose(step)
    q = proposal.draft_probabilities[0]  # [5, V]
    assert q.shape == (5, VOCAB_SIZE)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    assert ((q > 0).sum(-1) <= 4).all()  # only the top-4 candidates
    assert (q[torch.arange(5), proposal.tokens[0]] > 0).all()


def test_dflash2_sampling_follows_the_target_distribution(sampling_setup):
    """One setting (the selector's q over K=4 of 6 tokens, after temperature and top-p) keeps CI short."""
    target, input_ids = sampling_setup
    temperature, top_k, top_p = 0.9, None, 0.9
    draft = make_variant_draft("dflash2", seed=12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    counts, accepted = sampled_counts(target, DFlashProposer(draft, target, VOCAB - 1), input_ids,
                                      torch.Generator().manual_seed(99), max_new_tokens=NUM_NEW, block_size=4,
                                      temperature=temperature, top_k=top_k, top_p=top_p)
    assert accepted > NUM_SAMPLES // 10
    assert_follows(counts, exact_joint(target, input_ids, temperature, top_k, top_p),
                   exact_joint(target, input_ids, temperature * 1.5, top_k, top_p))


# --- Training ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["sliding_mixed", "all_causal", "sliding_bidirectional"])
def test_training_blocks_in_one_pass_equal_one_block_at_a_time(targets, variant):
    """The sparse block mask plus each layer's causal / window rule gives every block what decoding gives it."""
    target, draft = targets["qwen3"], make_variant_draft(variant, seed=0, block_size=4)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (24,), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([2, 9, 20])
    blocks = build_blocks(input_ids, torch.ones(24), anchors, 4, VOCAB_SIZE - 1)
    weight = target.get_input_embeddings().weight
    with torch.no_grad():
        features = select_features(target(input_ids[None], output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        embeddings = draft.embed_block(blocks.block_ids, weight)[None]
        together = draft(embeddings, features, blocks.block_position_ids[None], torch.arange(24)[None],
                         attention_mask=blocks.attention_mask[None, None], block_length=4)
        for k, anchor in enumerate(anchors.tolist()):
            rows = slice(4 * k, 4 * k + 4)
            alone = draft(embeddings[:, rows], features[:, :anchor], blocks.block_position_ids[None, rows],
                          torch.arange(anchor)[None])
            torch.testing.assert_close(together[:, rows], alone, rtol=1e-5, atol=1e-5)


def test_training_a_dflash2_draft_is_refused(targets):
    draft = make_variant_draft("dflash2")
    with pytest.raises(ValueError, match="Training DFlash2 drafts"):
        dflash_loss(draft, targets["qwen3"], torch.arange(10), torch.ones(10), num_anchors=2)


# --- Exported remote code, where dflash_hf cannot be imported -----------------------------------------------------

RUN_WITHOUT_PACKAGE = textwrap.dedent("""
    import json, sys
    sys.modules["dflash_hf"] = None
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    folders, target_dir, prompt = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    results = {}
    for name, folder in folders.items():
        draft = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        output = draft.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=20, block_size=6)
        results[name] = {"ids": output[0].tolist(), "class": type(draft).__name__, "module": type(draft).__module__}
    print(json.dumps(results))
""")


def test_every_variant_runs_from_exported_remote_code(tmp_path, targets):
    target, sequence = targets["llama"], random_prompt(500 + 10, 7)[0].tolist()
    folders, expected = {}, {}
    for variant in VARIANTS:
        draft = make_variant_draft(variant, seed=8)
        expected[variant] = draft.spec_generate(target=target, input_ids=torch.tensor([sequence]), max_new_tokens=20,
                                                block_size=6)[0].tolist()
        draft.save_pretrained(tmp_path / variant)
        folders[variant] = str(tmp_path / variant)
    target.save_pretrained(tmp_path / "target")
    (tmp_path / "run.py").write_text(RUN_WITHOUT_PACKAGE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    completed = subprocess.run([sys.executable, str(tmp_path / "run.py"), json.dumps(folders),
                                str(tmp_path / "target"), json.dumps(sequence)],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    for variant in VARIANTS:
        assert results[variant]["module"].startswith("transformers_modules")
        assert results[variant]["class"] == ("DFlash2DraftModel" if variant == "dflash2" else "DFlashDraftModel")
        assert results[variant]["ids"] == expected[variant], variant
