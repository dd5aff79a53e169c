"""Tiny seeded models and test doubles shared by the tests."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_hf import DFlashConfig, DFlashDraftModel, DraftStep, left_pad
from dflash_hf.proposer_dflash import DFlashProposer

VOCAB_SIZE = 128
HIDDEN_SIZE = 64
TARGET_LAYERS = 4


def make_target(arch: str = "qwen3", seed: int = 0, vocab_size: int = VOCAB_SIZE, init_std: float = 0.1,
                max_position_embeddings: int = 256) -> torch.nn.Module:
    """A tiny random float32 Qwen3 or Llama causal LM in eval mode."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position_embeddings,
        initializer_range=init_std, tie_word_embeddings=False,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=500000.0))
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None  # random weights: no end-of-text token (tests pass their stop ids)
    return model.eval()


# Tiny hybrid targets (tests/test_hybrid_targets.py): three Gated DeltaNet layers to each full-attention layer.
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl")
# Other recurrent families of Transformers 5.x: (config class, model class, config fields); layer 2 is attention.
MIXED = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
MAMBA = dict(mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=8)
RECURRENT_FAMILIES = {
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=MIXED)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, layer_types=MIXED)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, layers_block_type=["linear_attention", "moe", "full_attention",
                                                               "linear_attention"],
        mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, layer_types=MIXED, position_embedding_type="rope", **MAMBA)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, conv_L_cache=3, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "conv", "full_attention", "conv"])),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, conv_L_cache=3, moe_intermediate_size=32, num_dense_layers=1,
        num_experts=4, num_experts_per_tok=2, layer_types=["conv", "conv", "full_attention", "conv"])),
    # refused: see families_dflash.RECURRENT_REFUSALS
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(num_hidden_layers=4, num_key_value_heads=2,
                                                      attn_layer_indices=[2], **MAMBA)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, **MAMBA)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        block_size=16, layer_types=["full_attention", "linear_attention"] * 2)),
}


def make_hybrid_target(family: str = "qwen3_5", seed: int = 0, vocab_size: int = VOCAB_SIZE, init_std: float = 0.1,
                       num_layers: int = TARGET_LAYERS) -> torch.nn.Module:
    """A tiny random float32 hybrid causal LM (Transformers 5.x): `qwen3_next`, `qwen3_5`, `qwen3_5_moe`,
    `qwen3_5_vl` / `qwen3_5_moe_vl` (the multimodal ...ForConditionalGeneration wrappers that published Qwen3.5
    checkpoints are), or
    one of RECURRENT_FAMILIES (whose own shapes ignore `num_layers`)."""
    import transformers

    text = dict(vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                             for i in range(num_layers)],
                initializer_range=init_std, tie_word_embeddings=False, max_position_embeddings=256)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    torch.manual_seed(seed)
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**text, **experts, decoder_sparse_step=1)
        model = transformers.Qwen3NextForCausalLM(config)
    elif family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    elif family == "qwen3_5_moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text, **experts))
    elif family in RECURRENT_FAMILIES:
        config_class, model_class, fields = RECURRENT_FAMILIES[family]
        sizes = {**COMMON, "vocab_size": vocab_size, "initializer_range": init_std}
        config = getattr(transformers, config_class)(**sizes, **fields, pad_token_id=0)
        model = getattr(transformers, model_class)(config)
    elif family in ("qwen3_5_vl", "qwen3_5_moe_vl"):
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN_SIZE)
        if family == "qwen3_5_vl":
            config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
            model = transformers.Qwen3_5ForConditionalGeneration(config)
        else:
            config = transformers.Qwen3_5MoeConfig(text_config={**text, **experts}, vision_config=vision)
            model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = None
    return model.eval()


# Target families with attention layers only (tests/test_target_families.py, tests/test_compiled.py)
WINDOW = 8  # sliding window of the windowed families: prompts and generations below cross it
COMMON_DECODER = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128,
                      num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
ALTERNATING = ["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2)

# family -> (causal LM class, config class, config settings beyond COMMON_DECODER)
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", None),  # helpers.make_target
    "llama": ("LlamaForCausalLM", "LlamaConfig", None),
    # Llama 3.1's rope scaling, its original context (16) below the tests' prompts, so the scaled frequencies count
    "llama3_rope": ("LlamaForCausalLM", "LlamaConfig",
                    dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                high_freq_factor=4.0,
                                                                original_max_position_embeddings=16))),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",  # attention sinks; alternating sliding and full layers
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=ALTERNATING)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",  # soft-capped logits: the verify must not use the bare head
               dict(sliding_window=WINDOW, layer_types=ALTERNATING, final_logit_softcapping=3.0)),
    "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig",  # per-layer inputs, the last two layers reuse earlier K/V
               dict(sliding_window=WINDOW, layer_types=ALTERNATING, final_logit_softcapping=3.0,
                    hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB_SIZE, num_kv_shared_layers=2)),
    # Gemma-4 12B's kind (encoder-free multimodal, text here): keys as values and wider heads in its full layers
    "gemma4_unified": ("Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextConfig",
                       dict(sliding_window=WINDOW, layer_types=ALTERNATING, final_logit_softcapping=3.0,
                            attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1)),
}
WINDOWED = ["mistral", "gpt_oss", "gemma3", "gemma4", "gemma4_unified"]
SOFT_CAPPED = ["gemma3", "gemma4", "gemma4_unified"]


def transformers_class(name: str):
    """The class `name` of the installed Transformers; skips the test (with the reason) when it has none."""
    found = getattr(transformers, name, None)
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return found


def build_target(family: str) -> torch.nn.Module:
    """A tiny random float32 causal LM of `family` (FAMILIES) in eval mode, seed 0."""
    model_class, config_class, settings = FAMILIES[family]
    if settings is None:
        return make_target(family, seed=0)
    model_class, config_class = transformers_class(model_class), transformers_class(config_class)
    torch.manual_seed(0)
    model = model_class(config_class(**{**COMMON_DECODER, **settings}))
    model.generation_config.eos_token_id = None  # random weights: no end-of-text token
    return model.eval()


def draft_config(block_size: int = 8, num_layers: int = 2, mask_token_id: int | None = None,
                 vocab_size: int = VOCAB_SIZE, **overrides) -> DFlashConfig:
    """A tiny draft config in the published layout."""
    settings = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=1e6, block_size=block_size, num_target_layers=TARGET_LAYERS, initializer_range=0.1,
        dflash_config={"mask_token_id": vocab_size - 1 if mask_token_id is None else mask_token_id},
        architectures=["DFlashDraftModel"],
    )
    settings.update(overrides)
    return DFlashConfig(**settings)


def make_draft(seed: int = 0, **config_kwargs) -> DFlashDraftModel:
    """A tiny random float32 draft in eval mode."""
    torch.manual_seed(seed)
    return DFlashDraftModel(draft_config(**config_kwargs)).eval()


# Tiny drafts of every format in docs/formats.md (config overrides on `draft_config`, two layers).
DRAFT_VARIANTS = {
    "sliding_mixed": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "all_causal": dict(is_causal=True),
    "sliding_bidirectional": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=3,
                                  is_causal=False),
    "scaled": dict(input_embedding_scale=8.0, output_multiplier=0.5, final_logit_softcapping=3.0),
    "dflash2": dict(architectures=["DFlash2DraftModel"], conv_kernel_size=3, conv_group_size=4, selector_rank=8,
                    selector_top_k=4, layer_types=["sliding_attention", "full_attention"], sliding_window=6),
}


def make_variant_draft(variant: str, seed: int = 0, **config_kwargs) -> DFlashDraftModel:
    """A tiny random draft of one of DRAFT_VARIANTS; DFlash2's convolution kernels are random too (not identity)."""
    from dflash_hf.modeling_dflash import DFlash2DraftModel

    config = draft_config(**{**DRAFT_VARIANTS[variant], **config_kwargs})
    torch.manual_seed(seed)
    if variant != "dflash2":
        return DFlashDraftModel(config).eval()
    draft = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for layer in draft.layers:
            for convolution in (layer.attention_conv, layer.mlp_conv):
                convolution.base_kernel.add_(0.3 * torch.randn_like(convolution.base_kernel))
    return draft


def plain_greedy(target: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                 stop_token_ids: list[int] | None = None) -> torch.Tensor:
    """The target's own greedy decode (Transformers generate), ids [1, prompt + new]."""
    return target.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
        min_new_tokens=0 if stop_token_ids else max_new_tokens, do_sample=False,
        eos_token_id=stop_token_ids, pad_token_id=0,
    )


class ReferenceProposer:
    """Proposes known continuations (the target's own greedy output), optionally wrong after a random offset.

    `reference_ids` is [1, L] for one row, or a list of [1, L_i] (unpadded prompt + continuation) per batch
    row. It also checks what the loop hands it: committed tokens, positions that continue exactly where
    the previous step stopped, and features equal to the target's hidden states there.
    """

    def __init__(self, reference_ids: torch.Tensor | list[torch.Tensor], target: torch.nn.Module | None = None,
                 corrupt_seed: int | None = None, corrupt_rows: set[int] | None = None) -> None:
        references = reference_ids if isinstance(reference_ids, list) else [reference_ids]
        self.references = [reference[0].tolist() for reference in references]
        self.target = target
        self.target_layer_ids = [0, TARGET_LAYERS - 1] if target is not None else None
        self.rng = None if corrupt_seed is None else torch.Generator().manual_seed(corrupt_seed)
        self.corrupt_rows = corrupt_rows
        self.next_position: dict[int, int] = {}
        self.num_calls = 0

    def _check_features(self, step: DraftStep, index: int, row: int, sequence: list[int]) -> None:
        start = len(sequence) - 1
        valid = torch.ones(step.target_hidden.shape[1], dtype=torch.bool) if step.context_valid is None \
            else step.context_valid[index].cpu()
        positions = step.context_position_ids[index].cpu()[valid].tolist()
        assert positions == list(range(self.next_position.get(row, 0), start)), (row, positions, start)
        self.next_position[row] = start
        with torch.no_grad():
            full = self.target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        expected = torch.cat([full[i + 1] for i in self.target_layer_ids], dim=-1)[0, positions]
        torch.testing.assert_close(step.target_hidden[index].cpu()[valid], expected, rtol=1e-4, atol=1e-4)

    def propose(self, step: DraftStep) -> torch.Tensor:
        self.num_calls += 1
        rows = []
        for index, row in enumerate(step.row_ids):
            sequence, reference = step.sequences[index], self.references[row]
            start = len(sequence) - 1
            assert sequence == reference[: start + 1], "loop committed a token the target would not produce"
            if self.target is not None:
                self._check_features(step, index, row, sequence)
            proposals = reference[start + 1 : start + step.block_size]
            proposals += [0] * (step.block_size - 1 - len(proposals))
            if self.rng is not None and (self.corrupt_rows is None or row in self.corrupt_rows):
                wrong_from = int(torch.randint(0, step.block_size, (1,), generator=self.rng))
                for i in range(wrong_from, len(proposals)):
                    proposals[i] = (proposals[i] + 1) % VOCAB_SIZE
            rows.append(proposals)
        return torch.tensor(rows)


def assert_equal_up_to_near_tie(target: torch.nn.Module, output: torch.Tensor, expected: torch.Tensor,
                                relative_gap: float = 0.125) -> None:
    """Equal, or diverging first where the target's two best logits are nearly tied (bf16/fp16 rounding)."""
    length = min(output.shape[1], expected.shape[1])
    differs = (output[0, :length] != expected[0, :length]).nonzero()
    if not len(differs):
        assert output.shape == expected.shape
        return
    index = int(differs[0])
    with torch.no_grad():
        logits = target(expected[:, :index]).logits[0, -1].float()
    best, second = logits.topk(2).values.tolist()
    assert best - second <= relative_gap * max(abs(best), 1.0), f"divergence at {index} was not a near-tie"


def make_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A word-level tokenizer over 'w0' .. 'w{V-1}' with a chat template; id 1 is the end-of-turn token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w1", unk_token="w2")
    tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w1 {% endfor %}"
                               "{% if add_generation_prompt %}w4{% endif %}")
    return tokenizer


def make_char_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A character-level tokenizer (letters, digits, punctuation, space, then two-letter pieces) whose pieces join
    without spaces, as stop strings need; ids 0, 1, 2: pad, end of text, unknown."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<eos>", "<unk>"] + list(string.ascii_letters + string.digits + string.punctuation + " ")
    symbols += [first + second for first in "etaoin" for second in "etaoinsr"][: vocab_size - len(symbols)]
    backend = Tokenizer(models.WordLevel({symbol: i for i, symbol in enumerate(symbols)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


class FixedLogitsTarget(torch.nn.Module):
    """A stand-in target whose next-token logits are `logits` [V] after any prefix; it records the prefixes it saw."""

    def __init__(self, logits: list[float], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(len(logits), 1, dtype=dtype)
        self.register_buffer("next_logits", torch.tensor(logits, dtype=dtype))
        self.prefixes: list[list[int]] = []

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0, **kwargs):
        from types import SimpleNamespace

        self.prefixes.append(input_ids[0].tolist())
        return SimpleNamespace(logits=self.next_logits.expand(input_ids.shape[0], input_ids.shape[1], -1))


def random_prompt(seed: int, length: int, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """Seeded random prompt ids [1, length] (never the last id: the tiny drafts' mask token)."""
    return torch.randint(0, vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(seed))


class RecordingProposer(DFlashProposer):
    """A DFlash proposer that records every step: the proposals [N, B-1], each row's (by the caller's row index), and
    how far the draft cache's width exceeds the longest row's context."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[torch.Tensor] = []
        self.proposed: dict[int, list[list[int]]] = {}
        self.cache_excess: list[int] = []

    def propose(self, step: DraftStep):
        proposal = super().propose(step)
        tokens = getattr(proposal, "tokens", proposal)
        self.steps.append(tokens)
        for row, row_tokens in zip(step.row_ids, tokens.tolist()):
            self.proposed.setdefault(row, []).append(row_tokens)
        self.cache_excess.append(self.backend.cache.get_seq_length() - max(len(s) - 1 for s in step.sequences))
        return proposal


class TreeReferenceProposer:
    """Proposes candidates for trees: at each position k tokens with descending made-up probabilities, the target's
    own next token (from `reference_ids`, as for ReferenceProposer) at a random rank or missing; the argmax chain is
    the rank-0 tokens. Checks that the loop committed only the reference."""

    target_layer_ids = None

    def __init__(self, reference_ids: torch.Tensor | list[torch.Tensor], k: int = 4, seed: int = 0) -> None:
        import random

        references = reference_ids if isinstance(reference_ids, list) else [reference_ids]
        self.references = [reference[0].tolist() for reference in references]
        self.k, self.rng = k, random.Random(seed)

    def propose(self, step: DraftStep):
        from dflash_hf.proposer_dflash import Candidates, Proposal

        tokens, probabilities = [], []
        for index, row in enumerate(step.row_ids):
            sequence, reference = step.sequences[index], self.references[row]
            start = len(sequence) - 1
            assert sequence == reference[: start + 1], "loop committed a token the target would not produce"
            row_tokens, row_probabilities = [], []
            for offset in range(1, step.block_size):
                truth = reference[start + offset] if start + offset < len(reference) else 0
                candidates = self.rng.sample([t for t in range(VOCAB_SIZE - 1) if t != truth], self.k)
                rank = self.rng.randrange(self.k + 1)  # k: the truth is not among them
                if rank < self.k:
                    candidates[rank] = truth
                row_tokens.append(candidates)
                row_probabilities.append(sorted((self.rng.random() for _ in range(self.k)), reverse=True))
            tokens.append(row_tokens)
            probabilities.append(row_probabilities)
        candidate_tokens, candidate_probabilities = torch.tensor(tokens), torch.tensor(probabilities)
        return Proposal(candidate_tokens[..., 0], candidates=Candidates(candidate_tokens, candidate_probabilities))


# --- Reference math, prompts and files shared by several test modules ----------------------------------------


def rms(x, weight, eps=1e-6):
    """RMS norm, written out (the draft forward's reference)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta=1e6):
    """Rotary embedding at `positions` [T], written out (the draft forward's reference)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None].float() * inv_freq  # [T, D/2]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def prompts_of(lengths: list[int], seed: int, vocab_size: int = VOCAB_SIZE) -> list[torch.Tensor]:
    """Seeded random prompts [1, length] of the given lengths."""
    generator = torch.Generator().manual_seed(300 + seed)
    return [torch.randint(0, vocab_size - 1, (1, length), generator=generator) for length in lengths]


def left_pad_prompts(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [N, T] and their attention mask (pad id 0)."""
    return left_pad([prompt[0].tolist() for prompt in prompts], pad_token_id=0)


def save_tiny_target_and_prompts(tmp_path, num_prompts: int):
    """A tiny Llama target and its tokenizer in tmp_path/target; returns a JSONL file of `num_prompts` prompts."""
    target, tokenizer = make_target("llama", seed=3), make_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"w{10 + i} w{20 + i} w{30 + i}"})
                                 for i in range(num_prompts)))
    return prompts
