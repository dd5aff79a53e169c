"""vLLM speculators' DFlash format, both ways: `DFlashDraftModel.from_pretrained` reads it, `dflash-hf convert --to
speculators` writes it, and a draft comes back the same and decodes the same tokens as plain greedy."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import HIDDEN_SIZE, TARGET_LAYERS, VOCAB_SIZE, make_draft, make_target, make_variant_draft, plain_greedy
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_hf import DFlashDraftModel
from dflash_hf.cli import main
from dflash_hf.configuration_dflash import layer_attention
from dflash_hf.conversion import convert, to_speculators

IDS = {"mask_token_id": VOCAB_SIZE - 1, "target_layer_ids": [0, 2]}
OWN_VOCAB = list(range(0, VOCAB_SIZE - 1, 3))  # 43 of the 128 ids


def own_head_draft() -> DFlashDraftModel:
    draft = make_draft(3, dflash_config=IDS, draft_vocab_size=len(OWN_VOCAB))
    draft.set_draft_vocabulary(OWN_VOCAB)
    return draft


DRAFTS = {
    "full": lambda: make_draft(3, dflash_config=IDS),
    "sliding": lambda: make_variant_draft("sliding_mixed", 3, dflash_config=IDS),  # causal sliding, full bidirectional
    "bidirectional": lambda: make_variant_draft("sliding_bidirectional", 3, dflash_config=IDS),
    "own_head": own_head_draft,
    "vocab_list": lambda: make_draft(3, dflash_config={**IDS, "draft_vocab": OWN_VOCAB[::-1]}),
}


def attention_of(draft: DFlashDraftModel) -> list[tuple[bool, int | None]]:
    return [layer_attention(draft.config, i) for i in range(draft.config.num_hidden_layers)]


def write(tmp_path, draft: DFlashDraftModel, arch: str = "qwen3"):
    """The draft in the published layout, its target saved, and the speculators folder `convert` writes from them."""
    target = make_target(arch, seed=7)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "ours")
    main(["convert", str(tmp_path / "ours"), str(tmp_path / "speculators"), "--to", "speculators",
          "--verifier", str(tmp_path / "target")])
    return target, tmp_path / "speculators"


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_a_draft_comes_back_from_the_speculators_format_the_same(tmp_path, kind):
    draft = DRAFTS[kind]()
    target, folder = write(tmp_path, draft)
    back = DFlashDraftModel.from_pretrained(folder)
    expected_weights = dict(draft.state_dict())
    if kind == "vocab_list":  # written as an LM head of its own: the target's rows of the listed ids, ascending
        ids = torch.tensor(sorted(OWN_VOCAB))
        expected_weights["lm_head.weight"] = target.lm_head.weight[ids]
        expected_weights["d2t"] = ids - torch.arange(len(ids))
        expected_weights["t2d"] = torch.zeros(VOCAB_SIZE, dtype=torch.bool).index_fill_(0, ids, True)
        assert back.config.draft_vocab_size == len(OWN_VOCAB) and back.draft_vocab == sorted(OWN_VOCAB)
    assert set(back.state_dict()) == set(expected_weights)
    assert all(torch.equal(tensor, back.state_dict()[name]) for name, tensor in expected_weights.items())
    assert attention_of(back) == attention_of(draft)
    for name in ("block_size", "vocab_size", "layer_types", "hidden_size", "num_hidden_layers", "head_dim",
                 "rms_norm_eps", "intermediate_size", "num_key_value_heads", "hidden_act"):
        assert getattr(back.config, name) == getattr(draft.config, name), name
    assert back.config.dflash_config["target_layer_ids"] == [0, 2]
    assert back.config.dflash_config["mask_token_id"] == VOCAB_SIZE - 1
    assert back.rotary_emb.inv_freq.equal(draft.rotary_emb.inv_freq)
    for seed, length in ((0, 1), (1, 23)):
        input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, length), generator=torch.Generator().manual_seed(seed))
        expected = plain_greedy(target, input_ids, 30)
        assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30), expected)
        assert torch.equal(back.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30), expected)


def test_a_speculators_folder_converts_back_to_the_published_layout(tmp_path):
    draft = make_variant_draft("sliding_mixed", 3, dflash_config=IDS)
    _, folder = write(tmp_path, draft, arch="llama")
    main(["convert", str(folder), str(tmp_path / "back"), "--to", "dflash"])
    back = DFlashDraftModel.from_pretrained(tmp_path / "back")
    assert all(torch.equal(tensor, back.state_dict()[name]) for name, tensor in draft.state_dict().items())
    assert attention_of(back) == attention_of(draft)


@pytest.mark.parametrize("kind", ["full", "bidirectional", "own_head"])
def test_the_written_config_has_every_field_speculators_and_vllm_read(tmp_path, kind):
    """Field by field, what speculators' config classes (DFlashSpeculatorConfig, SpeculatorsConfig, VerifierConfig,
    GreedyTokenProposalConfig) and vLLM's speculators loader require, read from their source."""
    draft = DRAFTS[kind]()
    target, folder = write(tmp_path, draft)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["architectures"] == ["DFlashDraftModel"]
    layer = config["transformer_layer_config"]  # validated by speculators as a Qwen3Config
    assert isinstance(layer, dict) and layer["model_type"] == "qwen3"
    layer_config = Qwen3Config(**{key: value for key, value in layer.items() if key != "model_type"})
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "layer_types", "sliding_window"):
        assert getattr(layer_config, name) == getattr(draft.config, name), name
    assert layer["rope_theta"] == layer["rope_parameters"]["rope_theta"] == 1e6
    own_vocab = kind == "own_head"
    assert config["draft_vocab_size"] == (len(OWN_VOCAB) if own_vocab else VOCAB_SIZE)
    assert config["block_size"] == draft.config.block_size
    assert config["target_hidden_size"] is None
    assert config["aux_hidden_state_layer_ids"] == [1, 3]  # the target layer ids + 1
    assert config["mask_token_id"] == VOCAB_SIZE - 1
    assert config["sliding_window_non_causal"] is (kind == "bidirectional")
    assert config["sample_from_anchor"] is False
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "dflash"
    method, = speculators["proposal_methods"]
    assert method == {"proposal_type": "greedy", "speculative_tokens": draft.config.block_size - 1,
                      "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert speculators["default_proposal_method"] == method["proposal_type"]
    assert speculators["verifier"] == {"name_or_path": str(tmp_path / "target"), "architectures": ["Qwen3ForCausalLM"]}

    weights = load_file(folder / "model.safetensors")
    body = {name for name in draft.state_dict() if name not in ("lm_head.weight", "d2t", "t2d")}
    assert set(weights) == body | {"embed_tokens.weight", "lm_head.weight"} | ({"d2t", "t2d"} if own_vocab else set())
    assert torch.equal(weights["embed_tokens.weight"], target.model.embed_tokens.weight)
    if own_vocab:
        assert torch.equal(weights["lm_head.weight"], draft.lm_head.weight)
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert (torch.arange(len(OWN_VOCAB)) + weights["d2t"]).tolist() == OWN_VOCAB
        assert weights["t2d"].nonzero().flatten().tolist() == OWN_VOCAB
    else:
        assert torch.equal(weights["lm_head.weight"], target.lm_head.weight)


def speculators_folder(tmp_path, draft: DFlashDraftModel, target, **changes) -> str:
    """A folder as speculators' own converter writes it from a published draft (its config.json layout, read from
    speculators 0.9.0's output: the published config copied into `transformer_layer_config`, no Qwen3 defaults
    written, `architectures` the model class; weights under the same names plus the verifier's embedding and LM
    head); `changes` replace top-level fields."""
    layer = {key: value for key, value in draft.config.to_diff_dict().items()
             if key not in ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")}
    for default in ("rms_norm_eps", "hidden_act", "attention_bias"):  # Qwen3's defaults: speculators reads them there
        layer.pop(default, None)
    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"": "config.DFlashSpeculatorConfig"},
              "aux_hidden_state_layer_ids": [i + 1 for i in draft.config.dflash_config["target_layer_ids"]],
              "block_size": draft.config.block_size, "draft_vocab_size": VOCAB_SIZE, "dtype": "float32",
              "mask_token_id": VOCAB_SIZE - 1, "sample_from_anchor": False, "sliding_window_non_causal": False,
              "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                           "speculative_tokens": draft.config.block_size - 1,
                                                           "verifier_accept_k": 1}],
                                     "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "target"}},
              "speculators_model_type": "dflash", "speculators_version": "0.9.0", "target_hidden_size": None,
              "tie_word_embeddings": False, "transformer_layer_config": layer, **changes}
    folder = tmp_path / "from_speculators"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    weights = {**draft.state_dict(), "embed_tokens.weight": target.model.embed_tokens.weight,
               "lm_head.weight": target.lm_head.weight}
    save_file({name: tensor.detach().clone().contiguous() for name, tensor in weights.items()},
              folder / "model.safetensors")
    return folder


def test_a_folder_written_by_speculators_loads_and_decodes_like_plain_greedy(tmp_path):
    target, draft = make_target("qwen3", seed=7), make_variant_draft("sliding_mixed", 3, dflash_config=IDS)
    loaded = DFlashDraftModel.from_pretrained(speculators_folder(tmp_path, draft, target))
    assert all(torch.equal(tensor, loaded.state_dict()[name]) for name, tensor in draft.state_dict().items())
    assert loaded.config.rms_norm_eps == 1e-6 and loaded.config.hidden_act == "silu"  # Qwen3Config's defaults
    assert attention_of(loaded) == attention_of(draft)
    assert loaded.config.block_size == draft.config.block_size and loaded.config.num_target_layers is None
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 11), generator=torch.Generator().manual_seed(4))
    assert torch.equal(loaded.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30),
                       plain_greedy(target, input_ids, 30))


@pytest.mark.parametrize("changes, message", [
    ({"speculators_model_type": "eagle3"}, "of type 'eagle3' is not a DFlash draft"),
    ({"sample_from_anchor": True}, "sample_from_anchor: true"),
    ({"aux_hidden_state_layer_ids": [0, 3]}, "aux_hidden_state_layer_ids` of 1 or more"),
    ({"target_hidden_size": 2 * HIDDEN_SIZE}, "target of hidden size 128"),
])
def test_what_the_speculators_loader_cannot_run_exactly_is_refused_by_name(tmp_path, changes, message):
    folder = speculators_folder(tmp_path, make_draft(3, dflash_config=IDS), make_target("qwen3", seed=7), **changes)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(folder)


@pytest.mark.parametrize("draft, message", [
    (lambda: make_variant_draft("all_causal", dflash_config=IDS), "causal full-attention layers \\[0, 1\\]"),
    (lambda: make_variant_draft("scaled", dflash_config=IDS),
     "input_embedding_scale=8.0; output_multiplier=0.5; final_logit_softcapping=3.0"),
    (lambda: make_variant_draft("dflash2", dflash_config=IDS), "architectures=DFlash2DraftModel"),
    (lambda: make_draft(layer_style="gemma4", dflash_config=IDS), "layer_style=gemma4 \\(Gemma-4 layers"),
    (lambda: make_draft(architectures=["Qwen3DSparkModel"], markov_rank=8, markov_head_type="gated",
                        enable_confidence_head=True, dflash_config=IDS),
     "shifted_labels=True .*; markov_rank=8 .*; enable_confidence_head=True"),
    (lambda: make_draft(dflash_config={**IDS, "target_layer_ids": [0, TARGET_LAYERS - 1]}),
     "target layer 3, the target's last"),
    (lambda: make_draft(vocab_size=2 * VOCAB_SIZE, dflash_config=IDS), "256 LM-head rows|vocab_size 256"),
])
def test_what_the_speculators_format_cannot_express_is_refused_by_name(tmp_path, draft, message):
    with pytest.raises(ValueError, match=message):
        to_speculators(draft(), make_target("qwen3", seed=7), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_to_speculators_asks_for_the_target_first(tmp_path):
    with pytest.raises(ValueError, match="pass it: --verifier MODEL"):
        convert(tmp_path / "missing", tmp_path / "out", "speculators")
    with pytest.raises(SystemExit, match="pass it: --verifier MODEL"):
        main(["convert", str(tmp_path / "missing"), str(tmp_path / "out"), "--to", "speculators"])
