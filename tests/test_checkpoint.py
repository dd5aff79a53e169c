"""The published checkpoint layout (docs/formats.md) loads unchanged and round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_target
from safetensors.torch import load_file, save_file

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.configuration_dflash import (
    DFLASH2_FIELDS,
    REMOTE_CODE_FILES,
    default_target_layer_ids,
    is_dflash2,
    read_rope_parameters,
)
from dflash_hf.modeling_dflash import DFlash2DraftModel

CONFIGS = Path(__file__).resolve().parents[1] / "dflash_hf" / "published_configs"


def draft_field(config: dict, name: str, default=None):
    """A DFlash field as docs/formats.md reads it: `dflash_config[name]`, then the top level, then `default`."""
    value = (config.get("dflash_config") or {}).get(name)
    if value is None:
        value = config.get(name)
    return default if value is None else value


def published_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes exactly as docs/formats.md lists them."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    num_features = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (hidden, num_features * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"layers.{i}."
        shapes.update({
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            prefix + "self_attn.q_norm.weight": (head_dim,),
            prefix + "self_attn.k_norm.weight": (head_dim,),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        })
        if config.get("attention_bias"):  # Qwen3 attention with `attention_bias`: all four projections carry a bias
            shapes.update({
                prefix + "self_attn.q_proj.bias": (heads * head_dim,),
                prefix + "self_attn.k_proj.bias": (kv_heads * head_dim,),
                prefix + "self_attn.v_proj.bias": (kv_heads * head_dim,),
                prefix + "self_attn.o_proj.bias": (hidden,),
            })
    shapes.update(dflash2_shapes(config))
    return shapes


def dflash2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """DFlash2's extra parameters (docs/formats.md); none for a DFlash config or one lacking the DFlash2 sizes."""
    sizes = [draft_field(config, name) for name in ("conv_kernel_size", "conv_group_size", "selector_rank")]
    hidden = config["hidden_size"]
    if "DFlash2DraftModel" not in (config.get("architectures") or []) or None in sizes or hidden % sizes[1]:
        return {}
    kernel, group, rank = sizes
    shapes = {}
    for i in range(config["num_hidden_layers"]):
        for part in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{part}.base_kernel"] = (2, kernel, hidden)
            shapes[f"layers.{i}.{part}.kernel_projection.weight"] = (2 * kernel * (hidden // group), hidden)
    shapes.update({  # the published safetensors name the codebooks without a `.weight` suffix
        "candidate_selector.predecessor_codebook": (config["vocab_size"], rank),
        "candidate_selector.successor_codebook": (config["vocab_size"], rank),
        "candidate_selector.hidden_projection.weight": (rank, hidden),
    })
    return shapes


def build_on_meta(config: DFlashConfig) -> DFlashDraftModel:
    """The draft class the config names (DFlash or DFlash2), built without memory."""
    with torch.device("meta"):
        return (DFlash2DraftModel if is_dflash2(config) else DFlashDraftModel)(config)


def expected_attention(config_dict: dict) -> list[tuple[bool, int | None]]:
    """(causal, window) per layer as docs/formats.md defines it from the published fields."""
    layer_types = draft_field(config_dict, "layer_types", ["full_attention"] * config_dict["num_hidden_layers"])
    window, is_causal = draft_field(config_dict, "sliding_window"), draft_field(config_dict, "is_causal")
    kinds = []
    for kind in layer_types:
        sliding = kind == "sliding_attention"
        kinds.append((sliding if is_causal is None else is_causal, window if sliding else None))
    return kinds


PUBLISHED_FIELDS = {  # the newer fields of docs/formats.md and what a config without them means
    "layer_types": None, "sliding_window": None, "is_causal": None,
    "input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
}


def expected_fields(config_dict: dict) -> dict:
    expected = {name: draft_field(config_dict, name, default) for name, default in PUBLISHED_FIELDS.items()}
    expected["layer_types"] = expected["layer_types"] or ["full_attention"] * config_dict["num_hidden_layers"]
    if "DFlash2DraftModel" in (config_dict.get("architectures") or []):
        expected.update({name: draft_field(config_dict, name) for name in DFLASH2_FIELDS})
    return expected


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_published_configs_build_with_the_documented_weights(path):
    config_dict = json.loads(path.read_text())
    config = DFlashConfig.from_json_file(str(path))
    draft = build_on_meta(config)
    actual = {name: tuple(p.shape) for name, p in draft.state_dict().items()}
    assert actual == published_shapes(config_dict)
    assert draft.block_size == draft_field(config_dict, "block_size", 16)
    assert draft.target_layer_ids == config_dict["dflash_config"]["target_layer_ids"]
    assert draft.mask_token_id == config_dict["dflash_config"]["mask_token_id"]
    assert {name: getattr(config, name) for name in expected_fields(config_dict)} == expected_fields(config_dict)
    assert [layer.attention_kind for layer in draft.layers] == expected_attention(config_dict)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_published_configs_round_trip_through_save_pretrained(tmp_path, path):
    """The newer fields (layer types, window, causality, scaling, DFlash2 sizes) survive save and reload."""
    config_dict = json.loads(path.read_text())
    DFlashConfig.from_json_file(str(path)).save_pretrained(tmp_path)
    reloaded = DFlashConfig.from_pretrained(tmp_path)
    assert {name: getattr(reloaded, name) for name in expected_fields(config_dict)} == expected_fields(config_dict)
    assert reloaded.architectures == config_dict["architectures"]
    assert (reloaded.block_size, reloaded.dflash_config["target_layer_ids"],
            reloaded.dflash_config["mask_token_id"]) == (
        draft_field(config_dict, "block_size", 16), config_dict["dflash_config"]["target_layer_ids"],
        config_dict["dflash_config"]["mask_token_id"])
    rope = read_rope_parameters(DFlashConfig.from_json_file(str(path)))
    assert read_rope_parameters(reloaded) == rope


def test_dflash2_config_matches_the_published_checkpoint_size():
    """Qwen3.8-27B-DFlash2: one bfloat16 safetensors of 81 tensors, 3,848,808,960 bytes (README provenance)."""
    draft = build_on_meta(DFlashConfig.from_json_file(str(CONFIGS / "Qwen3.8-27B-DFlash2.json")))
    state = draft.state_dict()
    assert isinstance(draft, DFlash2DraftModel) and len(state) == 81
    assert 2 * sum(p.numel() for p in state.values()) == 3_848_808_960
    assert state["layers.0.attention_conv.kernel_projection.weight"].shape == (1280, 5120)


def test_qwen3_8b_config_matches_the_design_doc():
    config = json.loads((CONFIGS / "Qwen3-8B-DFlash-b16.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"], config["rms_norm_eps"], config["rope_theta"], config["rope_scaling"],
            config["max_position_embeddings"], config["vocab_size"]) == (4096, 32, 8, 128, 12288, 1e-6, 1e6, None,
                                                                         40960, 151936)
    assert (config["block_size"], config["num_target_layers"], config["num_hidden_layers"]) == (16, 36, 5)
    assert config["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(28, 1) == [14]
    assert default_target_layer_ids(4, 2) == [1, 1]


TINY = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "model_type": "qwen3",
    "block_size": 8, "num_target_layers": 4, "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 2]},
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "max_position_embeddings": 256, "vocab_size": 128, "layer_types": ["full_attention", "full_attention"],
    "sliding_window": None, "use_sliding_window": False, "attention_bias": False, "torch_dtype": "float32",
}


def write_published_folder(folder: Path, config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A folder as published on the Hub: config.json + model.safetensors, weights named as in the doc."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    full = dict(config, dflash_config={**config["dflash_config"], "target_layer_ids": config["dflash_config"].get(
        "target_layer_ids") or default_target_layer_ids(config["num_target_layers"], config["num_hidden_layers"])})
    weights = {name: torch.randn(shape, generator=generator) * 0.1 for name, shape in published_shapes(full).items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return weights


def load_and_check(folder: Path, weights: dict[str, torch.Tensor]) -> DFlashDraftModel:
    draft, info = DFlashDraftModel.from_pretrained(str(folder), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = draft.state_dict()
    for name, value in weights.items():
        assert torch.equal(state[name], value), name
    return draft.eval()


VARIANTS = {
    "as_published": {},
    "block_size_in_dflash_config": {"block_size": None,
                                    "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 2],
                                                      "block_size": 8}},
    "target_layer_ids_absent": {"dflash_config": {"mask_token_id": 127}},
    "mask_token_as_string": {"dflash_config": {"mask_token": "<|MASK|>", "target_layer_ids": [0, 2]}},
    "rope_parameters": {"rope_theta": None, "rope_scaling": None,
                        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_published_variants_load_without_missing_or_unexpected_keys(tmp_path, variant):
    config = {k: v for k, v in {**TINY, **VARIANTS[variant]}.items() if v is not None}
    weights = write_published_folder(tmp_path / "draft", config)
    draft = load_and_check(tmp_path / "draft", weights)
    assert draft.block_size == 8
    expected_layers = [0, 2] if variant != "target_layer_ids_absent" else default_target_layer_ids(4, 2)
    assert draft.target_layer_ids == expected_layers
    target = make_target("qwen3", seed=0)
    input_ids = torch.tensor([[3, 5, 7]])
    if variant == "mask_token_as_string":
        assert draft.mask_token_id is None
        with pytest.raises(ValueError, match="mask_token_id"):
            draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=4)
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=4, mask_token_id=127)
    else:
        assert draft.mask_token_id == 127
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=4)
    assert output.shape == (1, 7)


def test_rope_parameters_variant_gives_the_same_draft_as_rope_theta(tmp_path):
    weights = write_published_folder(tmp_path / "a", TINY)
    variant = {k: v for k, v in {**TINY, **VARIANTS["rope_parameters"]}.items() if v is not None}
    write_published_folder(tmp_path / "b", variant)
    classic, modern = load_and_check(tmp_path / "a", weights), load_and_check(tmp_path / "b", weights)
    assert torch.equal(classic.rotary_emb.inv_freq, modern.rotary_emb.inv_freq)


def test_save_pretrained_round_trip_is_hub_ready(tmp_path):
    weights = write_published_folder(tmp_path / "published", TINY)
    draft = load_and_check(tmp_path / "published", weights)
    draft.save_pretrained(tmp_path / "saved")
    files = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"config.json", "model.safetensors", *REMOTE_CODE_FILES} <= files
    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_config["auto_map"] == {"AutoConfig": "configuration_dflash.DFlashConfig",
                                        "AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert saved_config["architectures"] == ["DFlashDraftModel"]
    assert saved_config["model_type"] == "qwen3"
    assert saved_config["block_size"] == 8 and saved_config["num_target_layers"] == 4
    assert saved_config["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 2]}
    assert set(load_file(str(tmp_path / "saved" / "model.safetensors"))) == set(weights)
    reloaded = load_and_check(tmp_path / "saved", weights)
    target = make_target("llama", seed=1)
    input_ids = torch.tensor([[9, 8, 7, 6]])
    first = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=12, return_stats=True)
    second = reloaded.spec_generate(target=target, input_ids=input_ids, max_new_tokens=12, return_stats=True)
    assert torch.equal(first.output_ids, second.output_ids)
    assert first.acceptance_lengths == second.acceptance_lengths


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["DFlash3DraftModel"]}, r"\['DFlash3DraftModel'\] is not supported"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2 draft config needs a positive `conv_kernel_size`"),
    ({"architectures": ["DFlash2DraftModel"], "conv_kernel_size": 3, "conv_group_size": 5, "selector_rank": 4,
      "selector_top_k": 4}, "`conv_group_size` 5 must divide hidden_size 64"),
    ({"layer_types": ["sliding_attention", "full_attention"]},
     "sliding-attention layers but no positive `sliding_window`"),
    ({"layer_types": ["full_attention"]}, "layer.types"),  # Transformers' own check: it names the field
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"block_size": 1}, "block_size"),
])
def test_unsupported_drafts_are_refused(tmp_path, change, message):
    config = {k: v for k, v in {**TINY, **change}.items() if v is not None}
    write_published_folder(tmp_path / "draft", config)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(str(tmp_path / "draft"))


def test_a_config_without_block_size_takes_the_documented_default(tmp_path):
    """docs/formats.md: `block_size` is read from dflash_config, then the top level, then defaults to 16."""
    config = {k: v for k, v in TINY.items() if k != "block_size"}
    write_published_folder(tmp_path / "draft", config)
    assert DFlashDraftModel.from_pretrained(str(tmp_path / "draft")).block_size == 16
