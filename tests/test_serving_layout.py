"""An exported draft folder carries every key vLLM's and SGLang's DFlash loaders read (docs/serving.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_draft, make_variant_draft
from safetensors import safe_open

LAYER_KEYS = ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
              "self_attn.k_norm.weight")
SHIPPED = Path(__file__).resolve().parents[1] / "dflash_hf" / "drafts" / "smollm2-135m-instruct"


def exported(draft, folder: Path) -> tuple[dict, dict[str, list[int]]]:
    """The config.json and the weight shapes {name: shape} of `draft` saved to `folder`."""
    draft.save_pretrained(folder)
    return read_folder(folder)


def read_folder(folder: Path) -> tuple[dict, dict[str, list[int]]]:
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        shapes = {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}
    return config, shapes


def assert_servable(config: dict, shapes: dict[str, list[int]]) -> None:
    """What docs/serving.md's table promises, key by key."""
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    dflash_config = config["dflash_config"]
    assert (isinstance(dflash_config["mask_token_id"], int)
            and 0 <= dflash_config["mask_token_id"] < config["vocab_size"])
    layer_ids = dflash_config["target_layer_ids"]
    assert layer_ids and all(isinstance(i, int) and 0 <= i < config["num_target_layers"] for i in layer_ids)
    assert isinstance(config["block_size"], int) and config["block_size"] >= 2
    hidden = config["hidden_size"]
    assert isinstance(config["head_dim"], int) and isinstance(config["rope_theta"], float)
    assert config.get("target_hidden_size", hidden) == hidden
    if "sliding_attention" in config.get("layer_types", []):
        assert config["use_sliding_window"] is True and isinstance(config["sliding_window"], int)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{layer}.{key}" for layer in range(config["num_hidden_layers"]) for key in LAYER_KEYS}
    assert set(shapes) == expected  # no `model.` prefix, nothing missing, nothing extra
    assert shapes["fc.weight"] == [hidden, len(layer_ids) * hidden]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    assert shapes["layers.0.self_attn.q_proj.weight"] == [heads * head_dim, hidden]
    assert shapes["layers.0.self_attn.k_proj.weight"] == [kv_heads * head_dim, hidden]


@pytest.mark.parametrize("variant", [None, "sliding_mixed", "sliding_bidirectional", "scaled"])
def test_an_exported_draft_has_what_the_servers_read(tmp_path, variant):
    draft = make_draft(0) if variant is None else make_variant_draft(variant)
    assert_servable(*exported(draft, tmp_path))


def test_the_shipped_draft_has_what_the_servers_read():
    assert_servable(*read_folder(SHIPPED))


def test_a_sliding_window_survives_the_round_trip_through_the_qwen3_config(tmp_path):
    """Transformers' Qwen3 config drops `sliding_window` unless `use_sliding_window` is set: the servers read it."""
    config, _ = exported(make_variant_draft("sliding_mixed"), tmp_path)
    assert config["sliding_window"] == 5 and config["layer_types"] == ["sliding_attention", "full_attention"]


def test_a_broken_layout_is_caught(tmp_path):
    """The checks above can fail: a folder with a `model.` prefix or a wrong fc shape does not pass."""
    config, shapes = exported(make_draft(0), tmp_path)
    with pytest.raises(AssertionError):
        assert_servable(config, {f"model.{name}": shape for name, shape in shapes.items()})
    with pytest.raises(AssertionError):
        assert_servable(config, {**shapes, "fc.weight": [config["hidden_size"], config["hidden_size"]]})
    with pytest.raises(AssertionError):
        assert_servable({**config, "dflash_config": {**config["dflash_config"], "mask_token_id": None}}, shapes)
