"""Conversion to and from Transformers' native DFlash draft (MuseGlimmerAssistantModel), weight-exact,
same decoding."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import VOCAB_SIZE, RecordingProposer, make_draft, make_target, make_variant_draft, plain_greedy
from safetensors.torch import save_file
from transformers import AutoModel

from dflash_hf import DFlashDraftModel, speculative_decode
from dflash_hf.cli import main
from dflash_hf.configuration_dflash import NATIVE_DEFAULTS
from dflash_hf.conversion import from_native, to_native

try:
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
except ImportError:  # Transformers < 5.24
    MuseGlimmerAssistantModel = None
needs_native = pytest.mark.skipif(MuseGlimmerAssistantModel is None, reason="Transformers < 5.24 has no native DFlash")

DRAFTS = {"full": lambda: make_draft(3, block_size=8),
          "sliding": lambda: make_variant_draft("sliding_bidirectional", 3)}


def native_generate(target, native, input_ids, max_new_tokens, monkeypatch) -> tuple[torch.Tensor, list[list[int]]]:
    """Transformers' own DFlash path, and the candidates its generator drafted at each step."""
    drafted, original = [], DFlashTokenCandidateGenerator.get_candidates

    def recording(self, ids, *args, **kwargs):
        candidates = original(self, ids, *args, **kwargs)
        if candidates[0].shape[1] > ids.shape[1]:
            drafted.append(candidates[0][0, ids.shape[1]:].tolist())
        return candidates

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", recording)
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=native,
                             speculation_type="dflash", do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, pad_token_id=0)
    return output, drafted


@needs_native
def test_native_defaults_table_is_the_native_class_defaults():
    defaults = MuseGlimmerAssistantConfig().to_dict()
    for name, value in NATIVE_DEFAULTS.items():
        expected = None if name == "layer_types" else defaults[name]  # the class fills all-sliding when absent
        assert value == expected or (name == "layer_types" and defaults[name] == ["sliding_attention"] * 5), name


@needs_native
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", list(DRAFTS))
def test_converted_drafts_decode_like_plain_greedy_in_both_loops(tmp_path, monkeypatch, arch, kind):
    target, draft = make_target(arch, seed=7), DRAFTS[kind]()
    draft.save_pretrained(tmp_path / "ours")
    main(["convert", str(tmp_path / "ours"), str(tmp_path / "native"), "--to", "transformers"])
    assert json.loads((tmp_path / "native" / "config.json").read_text())["model_type"] == "muse_glimmer_assistant"
    native = AutoModel.from_pretrained(tmp_path / "native")  # no remote code: Transformers' own class
    assert type(native) is MuseGlimmerAssistantModel
    native_loaded_as_ours = DFlashDraftModel.from_pretrained(tmp_path / "native")  # spec_generate on a native folder
    for seed, length in ((0, 1), (1, 23)):
        input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, length), generator=torch.Generator().manual_seed(seed))
        expected = plain_greedy(target, input_ids, 30)
        output, native_drafted = native_generate(target, native, input_ids, 30, monkeypatch)
        assert torch.equal(output, expected)
        proposer = RecordingProposer(native_loaded_as_ours, target, VOCAB_SIZE - 1)
        assert torch.equal(speculative_decode(target, proposer, input_ids, max_new_tokens=30,
                                              block_size=8).output_ids, expected)
        # both loops draft full blocks until ours shortens its last ones to what is still needed: there, the same
        full_blocks = [proposals for proposals in proposer.proposed[0] if len(proposals) == 7]
        assert len(full_blocks) >= 10 and native_drafted[: len(full_blocks)] == full_blocks


@needs_native
@pytest.mark.parametrize("kind", list(DRAFTS))
def test_round_trip_is_weight_exact_and_keeps_every_dflash_field(tmp_path, kind):
    draft = DRAFTS[kind]()
    draft.config.dflash_config["mask_token"] = "<mask>"
    draft.save_pretrained(tmp_path / "ours")
    main(["convert", str(tmp_path / "ours"), str(tmp_path / "native"), "--to", "transformers"])
    main(["convert", str(tmp_path / "native"), str(tmp_path / "back"), "--to", "dflash"])
    back = DFlashDraftModel.from_pretrained(tmp_path / "back")
    assert set(back.state_dict()) == set(draft.state_dict())
    assert all(torch.equal(tensor, back.state_dict()[name]) for name, tensor in draft.state_dict().items())
    for name in ("block_size", "num_target_layers", "vocab_size", "layer_types", "sliding_window", "hidden_size",
                 "num_hidden_layers", "head_dim", "rms_norm_eps", "intermediate_size"):
        assert getattr(back.config, name) == getattr(draft.config, name), name
    assert back.config.dflash_config == {**draft.config.dflash_config}
    assert [layer.attention_kind for layer in back.layers] == [layer.attention_kind for layer in draft.layers]
    assert back.rotary_emb.inv_freq.equal(draft.rotary_emb.inv_freq)
    # the Python API gives the same objects
    assert all(torch.equal(tensor, from_native(to_native(draft)).state_dict()[name])
               for name, tensor in draft.state_dict().items())


@needs_native
@pytest.mark.parametrize("variant,names", [
    ("all_causal", "causal layers \\[0, 1\\]"),
    ("sliding_mixed", "causal layers \\[0\\]"),
    ("scaled", "input_embedding_scale=8.0; output_multiplier=0.5; final_logit_softcapping=3.0"),
    ("dflash2", "architectures=DFlash2DraftModel"),
])
def test_what_the_native_class_cannot_express_is_refused_by_name(tmp_path, variant, names):
    with pytest.raises(ValueError, match=names):
        to_native(make_variant_draft(variant))
    make_variant_draft(variant).save_pretrained(tmp_path / "draft")
    with pytest.raises(SystemExit, match="cannot be expressed as Transformers' native DFlash draft"):
        main(["convert", str(tmp_path / "draft"), str(tmp_path / "native"), "--to", "transformers"])


@needs_native
def test_a_draft_with_its_own_lm_head_is_refused_by_name():
    with pytest.raises(ValueError, match="draft_vocab_size=40 \\(an LM head of its own"):
        to_native(make_draft(0, draft_vocab_size=40))


@needs_native
def test_a_deepspec_drafts_own_parts_are_refused_by_name():
    draft = make_draft(0, architectures=["Qwen3DSparkModel"], markov_rank=8, markov_head_type="vanilla",
                       enable_confidence_head=True)
    with pytest.raises(ValueError, match="shifted_labels=True .*; markov_rank=8 .*; enable_confidence_head=True"):
        to_native(draft)
    with pytest.raises(ValueError, match="shifted_labels=True \\(DeepSpec's block"):
        to_native(make_draft(0, architectures=["Qwen3DSparkModel"]))


@needs_native
def test_a_draft_with_gemma4_layers_is_refused_by_name():
    with pytest.raises(ValueError, match="layer_style=gemma4 \\(Gemma-4 layers"):
        to_native(make_draft(0, layer_style="gemma4"))


def write_native_folder(folder, source) -> None:
    """A native checkpoint of `source`'s weights as Transformers writes it: encoder.* names, inclusive window,
    defaults omitted, no vocabulary size (Transformers' native drafts do not record it)."""
    renames = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    weights = {}
    for name, tensor in source.state_dict().items():
        prefix = next((old for old in renames if name.startswith(old)), None)
        weights[renames[prefix] + name[len(prefix):] if prefix else name] = tensor.contiguous()
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "muse_glimmer_assistant", "architectures": ["MuseGlimmerAssistantModel"],
              "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "sliding_window": 2,
              "layer_types": ["sliding_attention", "sliding_attention"], "block_size": 8, "mask_token_id": 127,
              "target_layer_ids": [1, 3]}
    (folder / "config.json").write_text(json.dumps(config))


def test_a_native_folder_loads_as_our_draft_on_any_transformers(tmp_path):
    """DFlashDraftModel.from_pretrained reads a native folder, also where Transformers has no native class."""
    source = make_variant_draft("sliding_bidirectional", seed=5)
    write_native_folder(tmp_path / "native", source)
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "native")
    assert all(torch.equal(tensor, loaded.state_dict()[name]) for name, tensor in source.state_dict().items())
    assert (loaded.config.sliding_window, loaded.config.is_causal) == (3, False)  # |q - k| <= 2 is our window 3
    target, input_ids = make_target("qwen3", seed=2), torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert torch.equal(loaded.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20),
                       plain_greedy(target, input_ids, 20))


@pytest.mark.skipif(MuseGlimmerAssistantModel is not None, reason="this Transformers has the native class")
def test_convert_to_transformers_says_the_installed_transformers_lacks_the_class(tmp_path):
    make_draft(1).save_pretrained(tmp_path / "draft")
    with pytest.raises(SystemExit, match="has no native DFlash draft class .*Transformers >= 5.24"):
        main(["convert", str(tmp_path / "draft"), str(tmp_path / "native"), "--to", "transformers"])


def test_native_rope_is_read_as_the_native_class_reads_it():
    from dflash_hf.configuration_dflash import config_from_native

    base = {"model_type": "muse_glimmer_assistant", "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}
    assert config_from_native(base)["rope_theta"] == 500000.0  # the class default
    assert config_from_native({**base, "rope_theta": 1e6})["rope_theta"] == 1e6  # top level, as the class accepts
    assert config_from_native({**base,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 2e6}})["rope_theta"] == 2e6
    with pytest.raises(ValueError, match="not one rope with a `rope_theta`"):
        config_from_native({**base, "rope_parameters": {"rope_type": "default"}})


def test_a_native_draft_without_its_vocabulary_is_not_saved_with_a_made_up_one(tmp_path):
    write_native_folder(tmp_path / "native", make_variant_draft("sliding_bidirectional", seed=5))
    draft = DFlashDraftModel.from_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="does not record the target's vocabulary size"):
        draft.save_pretrained(tmp_path / "saved")
    with pytest.raises(SystemExit, match="--vocab-size V"):
        main(["convert", str(tmp_path / "native"), str(tmp_path / "ours"), "--to", "dflash"])
    main(["convert", str(tmp_path / "native"), str(tmp_path / "ours"), "--to", "dflash", "--vocab-size", "128"])
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["vocab_size"] == 128 and "vocab_size_unknown" not in saved["dflash_config"]


def test_a_draft_in_a_subfolder_loads(tmp_path):
    make_draft(4).save_pretrained(tmp_path / "repo" / "draft")
    assert DFlashDraftModel.from_pretrained(tmp_path / "repo", subfolder="draft").block_size == 8


@needs_native
def test_the_native_copy_keeps_float32_rope_in_a_bfloat16_draft():
    draft = make_draft(6).to(torch.bfloat16)
    native = to_native(draft)
    assert native.rotary_emb.inv_freq.dtype == torch.float32
    assert all(parameter.dtype == torch.bfloat16 for parameter in native.parameters())
    torch.testing.assert_close(native.rotary_emb.inv_freq, draft.rotary_emb.inv_freq, rtol=0, atol=0)
