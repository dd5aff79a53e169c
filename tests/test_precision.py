"""A float16 draft on target features beyond float16's range (Qwen3's hidden-state outliers pass 65,504): it fuses
them in float32 (`DFlashDraftModel.fuse_context`), so its proposals stay finite and match a float32 copy's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import HIDDEN_SIZE, make_draft, make_target, make_variant_draft, plain_greedy

from dflash_hf import DFlashDraftModel

VOCAB = 8
OUTLIER = 2e5  # a massive activation, as Qwen3's, past float16's max (65,504)
OUTLIER_CHANNEL = 5


def outlier_target(seed: int = 3) -> torch.nn.Module:
    """A tiny float32 Qwen3 whose first layer writes OUTLIER into one channel of the residual stream (every layer
    output from there on exceeds float16's range)."""
    target = make_target("qwen3", seed=seed, vocab_size=VOCAB, init_std=1.0)
    down_proj = target.model.layers[0].mlp.down_proj
    bias = torch.zeros(HIDDEN_SIZE)
    bias[OUTLIER_CHANNEL] = OUTLIER
    down_proj.bias = torch.nn.Parameter(bias)
    return target


def float16_copy(draft: DFlashDraftModel) -> DFlashDraftModel:
    return copy.deepcopy(draft).to(torch.float16)


def old_fuse_context(draft: DFlashDraftModel, target_hidden: torch.Tensor) -> torch.Tensor:
    """The context as computed before float16 drafts fused in float32: features cast to the draft's dtype first."""
    return draft.hidden_norm(draft.fc(target_hidden.to(draft.fc.weight.dtype)))


def draft_logits(draft: DFlashDraftModel, target: torch.nn.Module, features: torch.Tensor) -> torch.Tensor:
    """The draft's logits [1, B - 1, V] of block [token 2, MASK ...] after a context of features [1, C, F]."""
    context_length, block_size = features.shape[1], draft.block_size
    block_ids = torch.full((1, block_size), draft.mask_token_id)
    block_ids[0, 0] = 2
    block_positions = torch.arange(context_length - 1, context_length - 1 + block_size)[None]  # [1, B]
    with torch.no_grad():
        embeddings = draft.embed_block(block_ids, target.get_input_embeddings().weight)  # [1, B, H]
        hidden = draft(embeddings, features, block_positions, torch.arange(context_length)[None])  # [1, B, H]
        return target.lm_head(hidden[:, 1:].float())


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_float16_draft_on_outlier_features_matches_its_float32_copy(variant):
    target = outlier_target()
    draft32 = make_draft(3, block_size=6, vocab_size=VOCAB, mask_token_id=VOCAB - 1) if variant == "dflash" else \
        make_variant_draft("dflash2", 3, block_size=6, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    prompt = torch.randint(0, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden_states = target(prompt, output_hidden_states=True).hidden_states
    features = torch.cat([hidden_states[i + 1] for i in draft32.target_layer_ids], dim=-1)  # [1, C, L*H]
    assert features.abs().max() > torch.finfo(torch.float16).max  # the draft would see inf after a plain cast

    draft16 = float16_copy(draft32)
    logits16, logits32 = draft_logits(draft16, target, features), draft_logits(draft32, target, features)
    assert torch.isfinite(logits16).all()
    with torch.no_grad():
        assert torch.isfinite(draft16.fuse_context(features)).all()
    torch.testing.assert_close(logits16, logits32, rtol=0.02, atol=0.05)
    top2 = logits32.topk(2, dim=-1).values  # [1, B - 1, 2]
    clear = top2[..., 0] - top2[..., 1] > 0.1  # positions without a near-tie in float32
    assert clear.sum() >= 3
    assert torch.equal(logits16.argmax(-1)[clear], logits32.argmax(-1)[clear])  # the same proposals there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_range_drafts_fuse_as_before(dtype):
    """float32 and bfloat16 drafts take the plain path: bit-identical to the cast-then-project context."""
    draft = make_draft(4).to(dtype)
    features = torch.randn(2, 5, len(draft.target_layer_ids) * HIDDEN_SIZE) * 1e3  # [N, C, L*H]
    with torch.no_grad():
        assert torch.equal(draft.fuse_context(features), old_fuse_context(draft, features))
        assert draft.fuse_context(features).dtype == dtype


def test_float16_draft_on_outlier_target_is_lossless_and_keeps_accepting():
    target = outlier_target()
    prompt = torch.randint(0, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(3))
    expected = plain_greedy(target, prompt, max_new_tokens=30)
    draft32 = make_draft(3, block_size=6, vocab_size=VOCAB, mask_token_id=VOCAB - 1, initializer_range=1.0)
    draft16 = float16_copy(draft32)

    def decode(draft: DFlashDraftModel):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the draft's dtype differs from the target's (a warning says so)
            return draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=30, block_size=6,
                                       return_stats=True, cpu_kernels=False)

    fixed, reference = decode(draft16), decode(draft32)
    draft16.fuse_context = lambda target_hidden: old_fuse_context(draft16, target_hidden)  # the old cast path
    broken = decode(draft16)
    for result in (fixed, reference, broken):
        assert torch.equal(result.output_ids, expected)  # lossless whatever the draft proposes
    assert fixed.acceptance_lengths == reference.acceptance_lengths  # as the float32 copy accepts
    assert len(fixed.acceptance_lengths[0]) < len(broken.acceptance_lengths[0])  # fewer target forwards
    assert max(broken.acceptance_lengths[0]) == 1  # the old path's NaN proposals: nothing accepted


# --- Quantized targets (scripts/precision_check.py measures SmolLM2 in each precision) ------------------------------
# Weight-only quantizers compute each token's row on its own: a many-token verify equals one-token decoding up to
# float reordering, so greedy spec_generate reproduces the quantized target's own generate. bitsandbytes' LLM.int8
# does not: the columns it keeps in 16-bit are those where ANY token of the forward reaches `threshold`.

QUANTIZED_CASES = [(0, 5, 8), (1, 9, 4), (2, 13, 6), (5, 6, 5)]  # (prompt seed, prompt length, block size)


def greedy_pairs(target: torch.nn.Module, cases=QUANTIZED_CASES, max_new_tokens: int = 16, **spec_kwargs):
    """(spec_generate, generate) greedy outputs of a tiny float32 draft with `target`, per case."""
    from helpers import random_prompt

    draft = make_draft(1, block_size=8)
    pairs = []
    for seed, length, block_size in cases:
        prompt = random_prompt(seed, length)
        expected = plain_greedy(target, prompt, max_new_tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=max_new_tokens,
                                         block_size=block_size, **spec_kwargs)
        pairs.append((output, expected))
    return pairs


def torchao_int8_target(include_lm_head: bool = False) -> torch.nn.Module:
    """A tiny seeded float32 Qwen3 with torchao int8 weight-only Linear weights (the LM head kept in float32 unless
    `include_lm_head`, as Transformers' TorchAoConfig keeps it)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    target = make_target("qwen3", seed=1)
    quantize_(target, Int8WeightOnlyConfig(),
              filter_fn=lambda module, name: isinstance(module, torch.nn.Linear)
              and (include_lm_head or name != "lm_head"))
    # really quantized: torchao's Int8Tensor, or AffineQuantizedTensor on torchao 0.9 (CI's oldest end, torch 2.6)
    assert type(target.model.layers[0].mlp.down_proj.weight).__name__ in ("Int8Tensor", "AffineQuantizedTensor")
    return target


@pytest.mark.parametrize("include_lm_head", [False, True])
def test_torchao_int8_weight_only_target_is_lossless(include_lm_head):
    pytest.importorskip("torchao")
    target = torchao_int8_target(include_lm_head)
    for output, expected in greedy_pairs(target):  # the CPU kernels on: a quantized LM head is called, not multiplied
        assert torch.equal(output, expected)


def bitsandbytes_target(kind: str, threshold: float = 6.0, init_std: float = 1.0) -> torch.nn.Module:
    """A tiny seeded float32 Qwen3 whose Linear layers but the LM head are bitsandbytes 8-bit (LLM.int8 with
    `threshold`) or nf4 (float32 compute), on the CPU. init_std 1.0: activations pass the default threshold 6.0."""
    import bitsandbytes as bnb

    target = make_target("qwen3", seed=1, init_std=init_std)
    for module in list(target.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                if kind == "8bit":
                    layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                                has_fp16_weights=False, threshold=threshold)
                else:
                    layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              quant_type="nf4", compute_dtype=torch.float32)
                layer.load_state_dict(child.state_dict())
                setattr(module, name, layer.to("cpu"))  # quantizes the weight
    return target.eval()  # in training mode bitsandbytes' CPU 8-bit path multiplies dequantized weights instead


def verify_versus_decode_gap(target: torch.nn.Module, length: int = 12, block: int = 8) -> float:
    """Largest logit difference between one forward of `block` tokens after a cached prefix (a verify) and the same
    tokens fed one at a time (decoding)."""
    from helpers import random_prompt
    from transformers import DynamicCache

    from dflash_hf.versions_dflash import cache_keyword

    ids = random_prompt(0, length + block)
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(ids[:, :length], **{cache_keyword(target): cache})
        verify = target(ids[:, length:], **{cache_keyword(target): cache}).logits[0]
        cache = DynamicCache(config=target.config)
        target(ids[:, :length], **{cache_keyword(target): cache})
        decode = torch.cat([target(ids[:, i:i + 1], **{cache_keyword(target): cache}).logits[0]
                            for i in range(length, length + block)])
    return (verify - decode).abs().max().item()


def test_bitsandbytes_nf4_target_is_lossless():
    pytest.importorskip("bitsandbytes")
    target = bitsandbytes_target("nf4")
    assert verify_versus_decode_gap(target) < 1e-3  # weight-only: float reordering at most
    for output, expected in greedy_pairs(target):
        assert torch.equal(output, expected)


def test_bitsandbytes_int8_verify_differs_from_decoding_where_outliers_split_columns():
    """LLM.int8 (threshold 6.0, Transformers' default) keeps in 16-bit the input columns where any token of the call
    reaches the threshold, and quantizes each token's other columns with a scale taken over the call's columns: a
    token's result depends on the other tokens of its forward. A verify then computes other logits than one-token
    decoding (far beyond float reordering), and greedy spec_generate can leave the target's own greedy output.
    Without the outlier split (threshold 0) every row is quantized on its own and the outputs are identical."""
    pytest.importorskip("bitsandbytes")
    split, plain_int8 = bitsandbytes_target("8bit", threshold=6.0), bitsandbytes_target("8bit", threshold=0.0)
    assert verify_versus_decode_gap(split) > 0.05
    assert verify_versus_decode_gap(plain_int8) < 1e-3
    for output, expected in greedy_pairs(plain_int8):
        assert torch.equal(output, expected)
    identical = [torch.equal(output, expected) for output, expected in greedy_pairs(split)]
    assert not all(identical)  # at these seeds the last case leaves the target's greedy output
