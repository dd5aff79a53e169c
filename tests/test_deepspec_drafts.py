"""DeepSeek DeepSpec drafts (`Qwen3DSparkModel`: DFlash with shifted labels, DSpark's Markov and confidence heads).

They load unchanged through `DFlashDraftModel.from_pretrained` as a configuration of the DFlash draft, and the
proposer's Markov stage drafts each position after the token drafted before it. Checked against DeepSpec's own
inference code (a recorded golden fixture: proposals, outputs, acceptance per step), against the target's greedy
decode on several families and batch layouts, and against the target's distribution when sampling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from deepspec_fixture import (
    GEMMA4_GOLDEN,
    GOLDEN,
    gemma4_golden_target,
    golden_prompts,
    golden_target,
    write_deepspec_folder,
)
from helpers import (
    COMMON_DECODER,
    FAMILIES,
    VOCAB_SIZE,
    RecordingProposer,
    build_target,
    draft_config,
    plain_greedy,
    prompts_of,
    random_prompt,
    transformers_class,
)
from sampling_checks import NUM_NEW, NUM_SAMPLES, assert_follows, exact_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB
from test_compiled import COMPILES, DYNAMO_ONLY, compiled_graphs
from test_remote_code import LOAD_WITHOUT_PACKAGE
from torch._dynamo.utils import counters
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import dflash_hf.proposer_dflash as proposer_module
from dflash_hf import DFlashConfig, DFlashDraftModel, DraftStep, left_pad, speculative_decode
from dflash_hf.configuration_dflash import read_rope_parameters
from dflash_hf.loading import PUBLISHED_CONFIGS
from dflash_hf.modeling_dflash import DFlashRotaryEmbedding
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.settings_dflash import StepCosts
from dflash_hf.steps_dflash import worthwhile_width
from dflash_hf.target_dflash import select_features

GOLDEN_RECORD = json.loads(GOLDEN.read_text(encoding="utf-8"))
GEMMA4_RECORD = json.loads(GEMMA4_GOLDEN.read_text(encoding="utf-8"))
# (record, its target) of each golden fixture: DeepSpec's Qwen3 draft on a Qwen3 target, its Gemma-4 draft on Gemma-4's
GOLDENS = {"qwen3": (GOLDEN_RECORD, golden_target), "gemma4": (GEMMA4_RECORD, gemma4_golden_target)}
GOLDEN_VARIANTS = [f"{name}/{variant}" for name, (record, _) in GOLDENS.items() for variant in record["variants"]]
# DeepSpec's Gemma-4 drafts need Gemma-4's rope (Transformers >= 5.5); older ones refuse them (tested below)
needs_gemma4 = pytest.mark.skipif("proportional" not in ROPE_INIT_FUNCTIONS,
                                  reason=f"transformers {transformers.__version__} has no Gemma-4 rope")
MARKOV = {"dflash": {}, **{kind: dict(markov_rank=8, markov_head_type=kind, enable_confidence_head=True,
                                      confidence_head_with_markov=kind != "rnn")
                           for kind in ("vanilla", "gated", "rnn")}}
PUBLISHED = {"dflash_qwen3_4b_block7": 0, "dflash_qwen3_8b_block7": 0, "dflash_qwen3_14b_block7": 0,
             "dspark_qwen3_4b_block7": 256, "dspark_qwen3_8b_block7": 256, "dspark_qwen3_14b_block7": 256}
GEMMA4_PUBLISHED = {"dflash_gemma4_12b_block7": 0, "dspark_gemma4_12b_block7": 256}
# A tiny DeepSpec Gemma-4 draft config in DeepSpec's layout (`Gemma4DSparkModel`: the target's Gemma-4 text config with
# DeepSpec's fields), for `deepspec_draft(..., **GEMMA4_LAYOUT)`: keys as values, wider full-attention heads, Gemma-4's
# proportional rope
GEMMA4_LAYOUT = dict(architectures=["Gemma4DSparkModel"], attention_k_eq_v=True, global_head_dim=32,
                     num_global_key_value_heads=1, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
                     rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                         "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# confidence_threshold="auto": the DSpark paper's Appendix A curve (SPS 1, 0.5, 0.45 steps per second: seconds 1, 2,
# 1/0.45), and hand-set curves whose scheduled widths are mostly deep, mostly shallow, and cut short by a cliff (where
# a search over all widths would go on)
APPENDIX_A = StepCosts(draft=0.0, verify=(1.0, 2.0, 1 / 0.45))
SCHEDULE_COSTS = (StepCosts(draft=0.0, verify=(1.0, 1.3, 1.45, 1.6, 1.75, 1.9, 2.05, 2.2)),
                  StepCosts(draft=0.0, verify=(1.0, 1.5, 1.9, 2.3, 2.7, 3.1, 3.5, 3.9)),
                  StepCosts(draft=0.0, verify=(1.0, 1.4, 1.75, 1.76, 1.77, 1.78, 1.79, 1.8)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deepspec_draft(kind: str, seed: int = 0, block_size: int = 7, vocab_size: int = VOCAB_SIZE,
                   **overrides) -> DFlashDraftModel:
    """A tiny random DeepSpec draft (`kind`: a MARKOV key) from a config in DeepSpec's layout (its `block_size` counts
    the drafted rows); its Markov head scaled up so that its bias moves the argmax."""
    config = draft_config(**{"architectures": ["Qwen3DSparkModel"], "block_size": block_size, "vocab_size": vocab_size,
                             **MARKOV[kind], **overrides})
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config).eval()
    if draft.markov_head is not None:
        with torch.no_grad():
            draft.markov_head.markov_w2.weight.mul_(20.0)
    return draft


# --- Loading: DeepSpec's config keys and weight names ----------------------------------------------------------------


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_read_as_deepspec_drafts(name):
    config = DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "deepspec" / f"{name}.json"))
    assert config.architectures == ["DFlashDraftModel"] and config.shifted_labels
    assert config.block_size == 8  # DeepSpec's block 7: seven proposals, verified with the pending token
    assert config.markov_rank == PUBLISHED[name]
    assert config.markov_head_type == ("vanilla" if PUBLISHED[name] else None)
    assert config.enable_confidence_head == bool(PUBLISHED[name])
    assert config.dflash_config["mask_token_id"] == 151669
    with torch.device("meta"):
        draft = DFlashDraftModel(config)
    names = {name for name, _ in draft.named_parameters()}
    if PUBLISHED[name]:
        assert draft.markov_head.markov_w1.weight.shape == (config.vocab_size, 256)
        assert draft.confidence_head.proj.weight.shape == (1, config.hidden_size + 256)
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                "confidence_head.proj.bias"} <= names
    else:
        assert not any(name.startswith(("markov_head", "confidence_head")) for name in names)


@needs_gemma4
@pytest.mark.parametrize("name", GEMMA4_PUBLISHED)
def test_published_gemma4_configs_read_as_deepspec_drafts_with_gemma4_layers(name):
    """DeepSpec's Gemma-4 12B drafts: the target's Gemma-4 text config with DeepSpec's fields, read as a DFlash draft
    with Gemma-4 layers; the attention of its full layers (512-wide heads, one key/value head, keys as values), their
    proportional rope, Gemma's embedding scale sqrt(3840) and soft cap 30; a save reads back the same."""
    config = DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "deepspec" / f"{name}.json"))
    assert config.architectures == ["DFlashDraftModel"] and config.shifted_labels and config.block_size == 8
    assert (config.layer_style, config.attention_k_eq_v, config.head_dim, config.num_key_value_heads) == (
        "gemma4", True, 512, 1)
    assert read_rope_parameters(config) == {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}
    assert config.hidden_act == "gelu_pytorch_tanh" and config.final_logit_softcapping == 30.0
    assert config.input_embedding_scale == pytest.approx(3840**0.5)
    assert config.layer_types == ["full_attention"] * 5 and config.sliding_window is None
    assert config.dflash_config == {"target_layer_ids": [5, 17, 29, 41, 46], "mask_token_id": 4}
    assert config.num_target_layers == 48 and config.markov_rank == GEMMA4_PUBLISHED[name]
    assert config.enable_confidence_head == config.confidence_head_with_markov == bool(GEMMA4_PUBLISHED[name])
    assert DFlashConfig(**config.to_dict()).to_dict() == config.to_dict()
    with torch.device("meta"):
        draft = DFlashDraftModel(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in draft.state_dict().items()}
    assert shapes["layers.0.self_attn.q_proj.weight"] == (16 * 512, 3840)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (512, 3840)
    assert "layers.0.self_attn.v_proj.weight" not in shapes
    assert shapes["layers.4.pre_feedforward_layernorm.weight"] == (3840,) and shapes["layers.4.layer_scalar"] == (1,)
    assert shapes["layers.0.mlp.down_proj.weight"] == (3840, 15360) and shapes["fc.weight"] == (3840, 5 * 3840)
    inv_freq = DFlashRotaryEmbedding(config).inv_freq  # [256]: a quarter of the 256 frequencies turn
    assert tuple(inv_freq.shape) == (256,) and int((inv_freq > 0).sum()) == 64


def test_gemma4_drafts_are_refused_by_name_where_transformers_has_no_gemma4_rope(monkeypatch):
    """Transformers before 5.5 (4.57.6 among them) has no Gemma-4 and no "proportional" rope: the config says so."""
    monkeypatch.delitem(ROPE_INIT_FUNCTIONS, "proportional", raising=False)
    with pytest.raises(ValueError, match=r"Gemma4DSparkModel.*'proportional' rope.*transformers>=5\.5"):
        DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "deepspec" / "dspark_gemma4_12b_block7.json"))


def test_deepspec_config_keys_are_normalised_once():
    config = draft_config(architectures=["Qwen3DSparkModel"], block_size=7, **MARKOV["gated"])
    again = DFlashConfig(**config.to_dict())  # what a saved config reads as
    assert (config.block_size, again.block_size) == (8, 8)
    assert again.shifted_labels and again.markov_head_type == "gated" and again.confidence_head_with_markov


@pytest.mark.parametrize("overrides, message", [
    (dict(GEMMA4_LAYOUT, enable_moe_block=True), "enable_moe_block"),
    (dict(GEMMA4_LAYOUT, hidden_size_per_layer_input=8), "hidden_size_per_layer_input"),
    (dict(GEMMA4_LAYOUT, use_double_wide_mlp=True, num_kv_shared_layers=1), "use_double_wide_mlp"),
    (dict(GEMMA4_LAYOUT, global_head_dim=None), "global_head_dim"),
    (dict(GEMMA4_LAYOUT, rope_parameters={"sliding_attention": {"rope_theta": 1e4}}), "full-attention rope"),
    (dict(attention_k_eq_v=True), "attention_k_eq_v"),
    (dict(layer_style="gemma3"), "layer_style"),
    (dict(architectures=["Qwen3DSparkModel"], markov_rank=4), "markov_head_type"),
    (dict(architectures=["Qwen3DSparkModel"], markov_rank=4, markov_head_type="lstm"), "markov_head_type"),
    (dict(architectures=["Qwen3DSparkModel"], enable_confidence_head=True, confidence_head_with_markov=True),
     "confidence_head_with_markov"),
    (dict(markov_rank=4, markov_head_type="vanilla"), "shifted_labels"),
])
def test_bad_deepspec_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        draft_config(**overrides)


def test_a_deepspec_folder_loads_unchanged_and_saves_in_dflash_hf_layout(tmp_path):
    """DeepSpec's config.json and weight names as its own code wrote them (the golden fixture's); its copies of the
    target's embedding and LM head are left unread; a save and reload gives the same tokens."""
    variant = GOLDEN_RECORD["variants"]["dspark_rnn"]
    target = golden_target()
    folder = write_deepspec_folder(tmp_path / "deepspec", variant["config"], variant["shapes"], target,
                                   variant["seed"])
    draft = DFlashDraftModel.from_pretrained(folder)
    assert draft.shifted_labels and draft.markov_head.kind == "rnn" and draft.block_size == 5
    prompt = golden_prompts()[1]
    expected = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=16)
    draft.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["shifted_labels"] and saved["block_size"] == 5 and saved["markov_head_type"] == "rnn"
    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.spec_generate(target=target, input_ids=prompt, max_new_tokens=16), expected)
    assert torch.equal(expected, plain_greedy(target, prompt, max_new_tokens=16))


@needs_gemma4
def test_a_gemma4_deepspec_folder_loads_unchanged_and_equals_generate(tmp_path):
    """DeepSpec's Gemma-4 draft folder as its code wrote it (the Gemma-4 golden fixture's config and weight names):
    every tensor read but the borrowed copies (its layer scalars, not 1, among them), Gemma-4's layers built; a save
    and reload gives the same tokens, and they are the Gemma-4 target's greedy ones."""
    record = GEMMA4_RECORD["variants"]["dspark_vanilla"]
    target = gemma4_golden_target()
    draft, info = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / "deepspec", record["config"], record["shapes"], target, record["seed"]), output_loading_info=True)
    assert set(draft.state_dict()) == set(record["shapes"]) - {"embed_tokens.weight", "lm_head.weight"}
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert draft.config.layer_style == "gemma4" and draft.layers[0].self_attn.v_proj is None
    assert float(draft.layers[1].layer_scalar) != 1.0
    prompt = golden_prompts()[2]
    expected = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=16)
    assert torch.equal(expected, plain_greedy(target, prompt, max_new_tokens=16))
    draft.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["layer_style"] == "gemma4" and saved["attention_k_eq_v"] and saved["architectures"] == [
        "DFlashDraftModel"]
    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.spec_generate(target=target, input_ids=prompt, max_new_tokens=16), expected)


@needs_gemma4
def test_gemma4_block_embeddings_are_gemmas_in_bfloat16():
    """The block's embeddings are those of Gemma-4's own embedding module (DeepSpec's draft embeds with it), bit for
    bit in bfloat16, where it rounds sqrt(H) to bfloat16 before the product."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    draft = deepspec_draft("dflash", **GEMMA4_LAYOUT, hidden_size=60)  # sqrt(60): not a bfloat16 number
    module = Gemma4TextScaledWordEmbedding(VOCAB_SIZE, draft.config.hidden_size, 0,
                                           embed_scale=draft.config.hidden_size**0.5)
    with torch.no_grad():
        module.weight.normal_(generator=torch.Generator().manual_seed(0))
    module = module.to(torch.bfloat16)
    ids = torch.arange(VOCAB_SIZE).view(4, -1)
    embeddings = draft.embed_block(ids, module.weight)
    assert embeddings.dtype == torch.bfloat16 and torch.equal(embeddings, module(ids))
    assert not torch.equal(embeddings, F.embedding(ids, module.weight) * draft.config.hidden_size**0.5)


@needs_gemma4
def test_a_gemma4_deepspec_draft_runs_as_exported_remote_code_without_the_package(tmp_path):
    """The Gemma-4 DeepSpec draft, saved by dflash-hf, runs with trust_remote_code where dflash_hf cannot be imported:
    DeepSpec's recorded new tokens (the golden fixture's, its block) and the in-process run's acceptance."""
    record = GEMMA4_RECORD["variants"]["dspark_vanilla"]
    target = gemma4_golden_target()
    draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / "deepspec", record["config"], record["shapes"], target, record["seed"]))
    run = next(run for run in record["greedy"] if run["prompt"] == 1 and not run["threshold"])
    prompt = golden_prompts()[1][0].tolist()
    expected = draft.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=20,
                                   block_size=draft.block_size, return_stats=True)
    assert expected.new_tokens(0) == run["new_tokens"]
    draft.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    (tmp_path / "load.py").write_text(LOAD_WITHOUT_PACKAGE)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    completed = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(tmp_path / "draft"),
                                str(tmp_path / "target"), json.dumps(prompt), str(draft.block_size)],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote = json.loads(completed.stdout.strip().splitlines()[-1])
    assert remote["model_module"].startswith("transformers_modules")
    assert remote["ids"][len(prompt):] == run["new_tokens"]
    assert remote["acceptance"] == expected.acceptance_lengths


@needs_gemma4
def test_gemma4_drafts_equal_generate_on_the_class_gemma4_12b_loads_as():
    """AutoModelForCausalLM loads google/gemma-4-12B-it as Gemma4UnifiedForConditionalGeneration (text, image and
    audio in one decoder): a tiny one, given text, with the Gemma-4 DeepSpec draft: greedy equals generate."""
    _, _, settings = FAMILIES["gemma4_unified"]
    torch.manual_seed(0)
    config = transformers_class("Gemma4UnifiedConfig")(
        text_config={**COMMON_DECODER, **settings},
        vision_config=dict(mm_embed_dim=COMMON_DECODER["hidden_size"], output_proj_dims=COMMON_DECODER["hidden_size"],
                           mm_posemb_size=16),
        audio_config=dict(audio_embed_dim=16, hidden_size=16, output_proj_dims=16))
    target = transformers_class("Gemma4UnifiedForConditionalGeneration")(config).eval()
    target.generation_config.eos_token_id = None
    input_ids = random_prompt(731, 9)
    expected = plain_greedy(target, input_ids, max_new_tokens=20)
    draft = deepspec_draft("vanilla", seed=2, **GEMMA4_LAYOUT)
    for block_size, threshold in ((4, None), (8, None), (8, 0.5)):
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20, block_size=block_size,
                                     confidence_threshold=threshold)
        assert torch.equal(output, expected), (block_size, threshold)


# --- Golden: DeepSpec's own inference code -------------------------------------------------------------------------


class CutRecordingProposer(RecordingProposer):
    """Records each step's proposals and the length the confidence cut left (None: no cut)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lengths: list[int | None] = []

    def propose(self, step):
        proposal = super().propose(step)
        lengths = getattr(proposal, "lengths", None)
        self.lengths.append(None if lengths is None else int(lengths[0]))
        return proposal


def golden_draft(folder: Path, name: str) -> tuple[dict, dict, torch.nn.Module, DFlashDraftModel]:
    """(the fixture, its variant's record, the target, the draft loaded from the variant's DeepSpec folder) of a
    GOLDEN_VARIANTS name."""
    fixture_name, variant = name.split("/")
    if fixture_name == "gemma4" and "proportional" not in ROPE_INIT_FUNCTIONS:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma-4 rope")
    fixture, make = GOLDENS[fixture_name]
    record, target = fixture["variants"][variant], make()
    draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        folder / variant, record["config"], record["shapes"], target, record["seed"]))
    return fixture, record, target, draft


@pytest.mark.parametrize("variant", GOLDEN_VARIANTS)
def test_golden_runs_of_deepspec_are_reproduced(tmp_path, variant):
    """Greedy, batch 1, every prompt and threshold recorded: the same new tokens, the same B drafted tokens at every
    step (B = DeepSpec's block), the same cut and acceptance per step. DeepSpec never shortens its last block (it
    trims afterwards); dflash-hf narrows the blocks that reach max_new_tokens, so those steps are left out."""
    fixture, record, target, draft = golden_draft(tmp_path, variant)
    assert draft.block_size == fixture["block_size"] + 1
    prompts = golden_prompts()
    for run in record["greedy"]:
        proposer = CutRecordingProposer(draft, target, draft.mask_token_id,
                                        confidence_threshold=run["threshold"] or None)
        result = speculative_decode(target, proposer, prompts[run["prompt"]],
                                    max_new_tokens=fixture["max_new_tokens"], block_size=draft.block_size,
                                    stop_token_ids=[])
        where = f"prompt {run['prompt']} threshold {run['threshold']}"
        assert result.new_tokens(0) == run["new_tokens"], where
        # the steps before our loop narrows its block to what max_new_tokens leaves
        steps = sum(tokens.shape[1] == fixture["block_size"] for tokens in proposer.steps)
        assert steps >= len(run["acceptance_lengths"]) // 2
        assert result.acceptance_lengths[0][:steps] == run["acceptance_lengths"][:steps], where
        for index in range(steps):
            count = run["proposal_lengths"][index]
            assert proposer.lengths[index] in ((None, count) if count == fixture["block_size"] else (count,))
            assert proposer.steps[index][0, :count].tolist() == run["drafted"][index], f"{where} step {index}"


@pytest.mark.parametrize("variant", GOLDEN_VARIANTS)
def test_sampled_q_is_deepspecs_for_the_same_draws(tmp_path, monkeypatch, variant):
    """At temperature 1, after the prompt (the pending token: the target's greedy first one) and with DeepSpec's own
    draws forced on the walk, q at every position is the distribution DeepSpec drew that token from: the LM head's
    logits plus the Markov bias of the token drawn before it."""
    _, record, target, draft = golden_draft(tmp_path, variant)
    sampled = record["sampled_first_step"]
    prompt = golden_prompts()[sampled["prompt"]][0].tolist()
    drawn = iter(sampled["drafted"])

    def forced(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        if probabilities.dim() == 3:  # no Markov head: all positions at once
            return torch.tensor([sampled["drafted"]])
        return torch.full(probabilities.shape[:-1], next(drawn), dtype=torch.long)  # the walk: one position

    monkeypatch.setattr(proposer_module, "sample_from", forced)
    with torch.no_grad():
        hidden_states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        step = DraftStep(prompts=[prompt], generated=[[sampled["anchor"]]],
                         target_hidden=select_features(hidden_states, draft.target_layer_ids),
                         context_position_ids=torch.arange(len(prompt))[None], context_valid=None,
                         block_size=draft.block_size, row_ids=[0], temperature=1.0,
                         generators=(torch.Generator().manual_seed(0),))
        proposal = DFlashProposer(draft, target, draft.mask_token_id).propose(step)
    assert proposal.tokens[0].tolist() == sampled["drafted"]
    torch.testing.assert_close(proposal.draft_probabilities[0], torch.tensor(sampled["q"]), rtol=1e-4, atol=1e-6)


# --- Lossless: greedy chains equal generate -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("kind", list(MARKOV))
def test_greedy_chains_equal_generate(family, kind):
    target = build_target(family)
    for seed, length in ((0, 5), (1, 11)):
        input_ids = random_prompt(700 + seed, length)
        expected = plain_greedy(target, input_ids, max_new_tokens=20)
        draft = deepspec_draft(kind, seed=seed)
        for block_size in (2, 5, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                         block_size=block_size)
            assert torch.equal(output, expected), f"seed {seed} block_size {block_size}"
        if draft.confidence_head is not None:
            for threshold in (0.3, 0.6, 1.0):
                output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                             confidence_threshold=threshold)
                assert torch.equal(output, expected), f"seed {seed} threshold {threshold}"
            for costs in SCHEDULE_COSTS:
                output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                             confidence_threshold="auto", step_costs=costs)
                assert torch.equal(output, expected), f"seed {seed} scheduled by {costs}"


@needs_gemma4
@pytest.mark.parametrize("family", ["gemma4_unified", "gemma4", "qwen3"])
@pytest.mark.parametrize("kind", ["dflash", "vanilla"])
def test_gemma4_layer_drafts_equal_generate(family, kind):
    """DeepSpec's Gemma-4 draft (Gemma-4 layers, keys as values, proportional rope, sqrt(H) embeddings, soft cap) on
    Gemma-4 targets (12B's kind, and E-series' per-layer inputs and shared K/V) and a Qwen3 one: greedy equals
    generate over seeds, prompt lengths, blocks and confidence thresholds, and in a left-padded batch."""
    target = build_target(family)
    for seed, length in ((0, 5), (1, 11)):
        input_ids = random_prompt(720 + seed, length)
        expected = plain_greedy(target, input_ids, max_new_tokens=20)
        draft = deepspec_draft(kind, seed=seed, **GEMMA4_LAYOUT)
        assert draft.config.layer_style == "gemma4"
        for block_size in (2, 5, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                         block_size=block_size)
            assert torch.equal(output, expected), f"seed {seed} block_size {block_size}"
        if draft.confidence_head is not None:
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                         confidence_threshold=0.5)
            assert torch.equal(output, expected), f"seed {seed} threshold 0.5"
    prompts = prompts_of([3, 9, 6], seed=41)
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    result = deepspec_draft(kind, seed=3, **GEMMA4_LAYOUT).spec_generate(
        target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=18, block_size=6,
        return_stats=True)
    for row, ids in enumerate(prompts):
        assert result.new_tokens(row) == plain_greedy(target, ids, max_new_tokens=18)[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", list(MARKOV))
def test_left_padded_batches_equal_each_row_alone(kind):
    target = build_target("qwen3")
    prompts = prompts_of([3, 9, 6], seed=40)
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    draft = deepspec_draft(kind, seed=3)
    for threshold in ((None, 0.5, "auto") if draft.confidence_head is not None else (None,)):
        result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=18, block_size=6, return_stats=True,
                                     confidence_threshold=threshold,
                                     step_costs=SCHEDULE_COSTS[0] if threshold == "auto" else None)
        for row, ids in enumerate(prompts):
            expected = plain_greedy(target, ids, max_new_tokens=18)[0, ids.shape[1]:].tolist()
            assert result.new_tokens(row) == expected, f"row {row} threshold {threshold}"


def test_the_markov_walk_follows_the_tokens_it_drafts():
    """A vanilla Markov head planted with a chain a -> a+1 and no other signal proposes a, a+1, a+2, ... from anchor
    a - 1: each position's bias comes from the token drafted just before it (not from the anchor)."""
    target = build_target("qwen3")
    draft = deepspec_draft("vanilla", seed=0, markov_rank=VOCAB_SIZE)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB_SIZE))
        following = torch.roll(torch.eye(VOCAB_SIZE), 1, dims=0)  # column v: one-hot of v + 1
        draft.markov_head.markov_w2.weight.copy_(1e4 * following)
    proposer = RecordingProposer(draft, target, draft.mask_token_id)
    input_ids = torch.tensor([[5, 9, 20]])
    speculative_decode(target, proposer, input_ids, max_new_tokens=12, block_size=draft.block_size)
    first = plain_greedy(target, input_ids, max_new_tokens=1)[0, -1].item()
    assert proposer.steps[0][0].tolist() == [(first + k) % VOCAB_SIZE for k in range(1, 8)]


def test_a_cut_at_zero_verifies_the_pending_token_alone():
    target = build_target("qwen3")
    draft = deepspec_draft("gated", seed=1)
    input_ids = random_prompt(77, 6)
    result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=10, confidence_threshold=1.0,
                                 return_stats=True)
    assert result.acceptance_lengths[0] == [1] * 9  # sigmoid < 1 everywhere: only the anchor is sent
    assert torch.equal(result.output_ids, plain_greedy(target, input_ids, max_new_tokens=10))


def test_confidence_thresholds_and_unbuilt_combinations_are_refused_up_front():
    target, input_ids = build_target("qwen3"), random_prompt(3, 4)
    with pytest.raises(ValueError, match="confidence head"):
        deepspec_draft("dflash").spec_generate(target=target, input_ids=input_ids, max_new_tokens=8,
                                               confidence_threshold=0.5)
    with pytest.raises(ValueError, match="from 0 to 1"):
        deepspec_draft("vanilla").spec_generate(target=target, input_ids=input_ids, max_new_tokens=8,
                                                confidence_threshold=1.5)
    with pytest.raises(ValueError, match="tree_size .*confidence cut"):
        deepspec_draft("gated").spec_generate(target=target, input_ids=input_ids, max_new_tokens=8, tree_size=4,
                                              confidence_threshold=0.5)


def test_a_deepspec_dflash_tree_equals_generate():
    """Rank 0 (DeepSpec's DFlash) has no Markov head: its shifted block feeds the best-first tree unchanged."""
    target = build_target("llama")
    input_ids = random_prompt(31, 7)
    output = deepspec_draft("dflash", seed=4).spec_generate(target=target, input_ids=input_ids, max_new_tokens=16,
                                                            tree_size=6)
    assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=16))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_trees_over_a_markov_draft_equal_generate(kind):
    """Each node's children ranked by q after its own token (rnn: after its whole path); greedy trees stay exact."""
    for family in ("qwen3", "llama"):
        target = build_target(family)
        input_ids = random_prompt(41, 6)
        draft = deepspec_draft(kind, seed=5)
        for tree_size in (3, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=16, tree_size=tree_size)
            assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=16)), (family, tree_size)


class CandidatesRecordingProposer(DFlashProposer):
    """Keeps the candidates each proposal of a tree step hands the tree (`Proposal.candidates`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.candidates = []

    def propose(self, step):
        proposal = super().propose(step)
        self.candidates.append(proposal.candidates)
        return proposal


def test_a_markov_tree_ranks_children_after_their_parent():
    """No LM-head signal (a zero final norm) and a planted chain v -> v+1: each position's candidates are v+1 after
    the greedy path, then ties; a node's children are ranked by q after its own token, so the successor of every
    candidate of position 0 that is also a candidate of position 1 comes first under it."""
    target = build_target("qwen3")
    draft = deepspec_draft("vanilla", seed=0, markov_rank=VOCAB_SIZE)
    with torch.no_grad():
        draft.norm.weight.zero_()
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB_SIZE))
        draft.markov_head.markov_w2.weight.copy_(2.0 * torch.roll(torch.eye(VOCAB_SIZE), 1, dims=0))

    proposer = CandidatesRecordingProposer(draft, target, draft.mask_token_id)
    speculative_decode(target, proposer, torch.tensor([[5, 9, 20]]), max_new_tokens=12, block_size=draft.block_size,
                       tree_size=6)
    seen = proposer.candidates
    tokens, transitions = seen[0].tokens[0].tolist(), seen[0].transitions[0]  # [P][k], [P, k, k]
    checked = 0
    for parent, token in enumerate(tokens[0]):
        successor = (token + 1) % VOCAB_SIZE
        if successor in tokens[1]:
            assert tokens[1][int(transitions[1, parent].argmax())] == successor, (token, tokens[1])
            checked += 1
    assert checked >= 3


def test_an_rnn_tree_steps_each_nodes_state_from_its_parents():
    """An rnn head's state follows the whole path: the q a tree ranks a node's children by is the q a chain walk
    along that node's path gives (each node's state stepped from its parent's, not a sibling's), for every path of
    up to three candidates. Power: two nodes with the same token after different parents rank their children
    differently."""
    target = build_target("qwen3")
    draft = deepspec_draft("rnn", seed=2)

    proposer = CandidatesRecordingProposer(draft, target, draft.mask_token_id)
    speculative_decode(target, proposer, random_prompt(5, 6), max_new_tokens=6, block_size=draft.block_size,
                       tree_size=3)
    seen = proposer.candidates
    candidates = seen[0]
    assert candidates.transitions is None and candidates.after_path is not None
    markov = candidates.after_path.__self__.markov  # the step's MarkovStage: LM-head logits, hidden states, anchor
    tokens = candidates.tokens[0]  # [P, k]
    count = tokens.shape[1]
    paths = [(a,) for a in range(count)] + [(a, b) for a in range(count) for b in range(count)]
    paths += [(a, b, c) for a in range(count) for b in range(count) for c in range(count)]
    for path in paths:
        with torch.no_grad():  # the step's tensors were made in inference mode
            walk = proposer_module.MarkovStage(draft, markov.base, markov.hidden_states, markov.anchors, False)
            walked = torch.zeros(1, len(path) + 1, dtype=torch.long)
            for position, rank in enumerate(path):
                walk.logits(position, walked)
                walked[0, position] = tokens[position, rank]
            q = walk.logits(len(path), walked)[0].float().softmax(dim=-1)  # [V]: after the path
            torch.testing.assert_close(torch.tensor(candidates.after_path(0, path)), q[tokens[len(path)]])
    differs = [candidates.after_path(0, (a, b)) != candidates.after_path(0, (0, b))
               for a in range(1, count) for b in range(count)]
    assert any(differs)


# --- Sampling keeps the target's distribution ------------------------------------------------------------------------


@pytest.mark.parametrize("kind, threshold, tree_size", [("rnn", None, None), ("vanilla", 0.25, None),
                                                      ("gated", None, 3), ("rnn", None, 3)])
def test_sampled_markov_chains_follow_the_target_distribution(kind, threshold, tree_size):
    """Chi-square over 6^3 continuations, with the power check, for chains (rnn; vanilla with a confidence cut that
    falls on about half the rows) and trees (gated; rnn, each node's children ranked by q after its path); the
    draft's Markov head planted with the target's most likely token after each one-token prompt, so that proposals
    get accepted (and a wrong q would show)."""
    from sampling_checks import sampling_target

    target, input_ids = sampling_target()
    draft = deepspec_draft(kind, seed=12, block_size=3, vocab_size=VOCAB, markov_rank=VOCAB)
    with torch.no_grad():
        following = target(torch.arange(VOCAB)[:, None]).logits[:, -1].argmax(-1)  # [V]
        draft.norm.weight.mul_(0.05)  # small LM-head logits: the bias counts
        draft.confidence_head.proj.weight.mul_(10.0)  # at 0.25, about half the first proposals are cut (by anchor)
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        draft.markov_head.markov_w2.weight.copy_(torch.eye(VOCAB)[following].T)
        if kind == "rnn":  # its output reads the token before only
            draft.markov_head.joint_proj.weight[2 * VOCAB :] = 0.0
            draft.markov_head.joint_proj.bias[2 * VOCAB :] = 0.0
            draft.markov_head.joint_proj.weight[2 * VOCAB :, VOCAB : 2 * VOCAB] = 3.0 * torch.eye(VOCAB)
    proposer = DFlashProposer(draft, target, VOCAB - 1, confidence_threshold=threshold)
    temperature, top_k, top_p = 0.9, None, None
    counts, accepted = sampled_counts(target, proposer, input_ids, torch.Generator().manual_seed(5),
                                      max_new_tokens=NUM_NEW, block_size=4, temperature=temperature,
                                      tree_size=tree_size)
    assert accepted > NUM_SAMPLES // 10
    assert_follows(counts, exact_joint(target, input_ids, temperature, top_k, top_p),
                   exact_joint(target, input_ids, temperature * 1.5, top_k, top_p))


# --- compile=True ------------------------------------------------------------------------------------------------


@COMPILES
def test_compiled_golden_runs_keep_deepspecs_tokens_and_acceptance(tmp_path):
    """compile=True on the golden runs (every variant, with and without the confidence cut): DeepSpec's new tokens,
    and its acceptance at every step before the eager loop would narrow its block; a step that accepts the whole
    shifted block keeps one context column more than the draft's block has rows. After each draft's first call, its
    other prompts and thresholds compile nothing new."""
    target = golden_target()
    prompts = golden_prompts()
    torch._dynamo.reset()
    counters.clear()
    full_blocks = 0
    for variant, record in GOLDEN_RECORD["variants"].items():
        draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
            tmp_path / variant, record["config"], record["shapes"], target, record["seed"]))
        graphs = None
        for run in record["greedy"]:
            result = draft.spec_generate(target=target, input_ids=prompts[run["prompt"]],
                                         max_new_tokens=GOLDEN_RECORD["max_new_tokens"], stop_token_ids=[],
                                         confidence_threshold=run["threshold"] or None, compile=DYNAMO_ONLY,
                                         return_stats=True)
            where = f"{variant} prompt {run['prompt']} threshold {run['threshold']}"
            assert result.new_tokens(0) == run["new_tokens"], where
            # DeepSpec's steps before the eager loop narrows its block to what max_new_tokens leaves
            steps, left = 0, GOLDEN_RECORD["max_new_tokens"] - 1
            while steps < len(run["acceptance_lengths"]) and left >= draft.block_size:
                left -= run["acceptance_lengths"][steps]
                steps += 1
            assert result.acceptance_lengths[0][:steps] == run["acceptance_lengths"][:steps], where
            full_blocks += draft.block_size in result.acceptance_lengths[0]
            if graphs is not None:
                assert compiled_graphs() == graphs, (where, counters["stats"])
            graphs = compiled_graphs()
    assert full_blocks >= 3


@COMPILES
@pytest.mark.parametrize("kind", list(MARKOV))
def test_compiled_chains_and_trees_equal_generate_on_two_families(kind):
    """compile=True with DeepSpec's DFlash and each DSpark Markov head, chains and trees, on Qwen3 and Llama targets:
    the target's greedy tokens, and a second call (another prompt length and length budget) compiles nothing new."""
    draft = deepspec_draft(kind, seed=6)
    torch._dynamo.reset()
    counters.clear()
    for family in ("qwen3", "llama"):
        target = build_target(family)
        for tree_size in (None, 4):
            graphs = None
            for seed, length, new_tokens in ((0, 5, 14), (1, 9, 11)):
                input_ids = random_prompt(800 + seed, length)
                output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=new_tokens,
                                             block_size=5, tree_size=tree_size, compile=DYNAMO_ONLY)
                where = f"{family} tree_size {tree_size} seed {seed}"
                assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=new_tokens)), where
                if graphs is not None:
                    assert compiled_graphs() == graphs, (where, counters["stats"])
                graphs = compiled_graphs()


@COMPILES
@needs_gemma4
def test_a_compiled_gemma4_layer_draft_equals_generate_on_gemma4_12bs_kind():
    """compile=True with a DSpark draft of Gemma-4 layers (keys as values, four norms, proportional rope) on a
    Gemma-4 12B-kind target: greedy chains and trees equal generate; a second chain call compiles nothing new."""
    draft = deepspec_draft("vanilla", seed=3, **GEMMA4_LAYOUT)
    target = build_target("gemma4_unified")
    torch._dynamo.reset()
    counters.clear()
    graphs = None
    for tree_size, seed, length, new_tokens in ((None, 0, 6, 12), (None, 1, 9, 10), (4, 2, 5, 12)):
        input_ids = random_prompt(810 + seed, length)
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=new_tokens, block_size=5,
                                     tree_size=tree_size, compile=DYNAMO_ONLY)
        assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=new_tokens)), (tree_size, seed)
        if tree_size is None:
            assert graphs is None or compiled_graphs() == graphs, counters["stats"]
            graphs = compiled_graphs()


@COMPILES
def test_compiled_sampled_dspark_drafts_draw_what_the_eager_loop_draws(tmp_path):
    """Same seed, same tokens, for an rnn DSpark draft's sampled chains and trees (each position's q after the token
    drawn before it): the compiled backend changes no draw, so the distribution the eager loop keeps (chi-square,
    above) is kept. Compared until the eager loop narrows its last blocks. Power: other seeds draw other tokens."""
    record = GOLDEN_RECORD["variants"]["dspark_rnn"]
    target = golden_target()
    draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / "rnn", record["config"], record["shapes"], target, record["seed"]))
    prompt = golden_prompts()[1]
    new_tokens = 30
    compared = new_tokens - draft.block_size
    for tree_size in (None, 4):
        outputs = set()
        for seed in (0, 1, 2):
            arguments = dict(target=target, input_ids=prompt, max_new_tokens=new_tokens, temperature=1.0, seed=seed,
                             stop_token_ids=[], tree_size=tree_size)
            eager = draft.spec_generate(**arguments)[0, prompt.shape[1]:][:compared].tolist()
            compiled = draft.spec_generate(**arguments, compile=DYNAMO_ONLY)[0, prompt.shape[1]:][:compared]
            assert compiled.tolist() == eager, (tree_size, seed)
            outputs.add(tuple(eager))
        assert len(outputs) == 3


def test_published_readme_names_every_deepspec_config():
    text = (PUBLISHED_CONFIGS / "README.md").read_text(encoding="utf-8")
    for name in [*PUBLISHED, *GEMMA4_PUBLISHED]:
        assert f"`deepspec/{name}.json`" in text and f"deepseek-ai/{name}" in text
    assert Path(PUBLISHED_CONFIGS / "deepspec" / "dspark_qwen3_8b_block7.json").is_file()


# --- confidence_threshold="auto": the DSpark paper's confidence-scheduled verification (Algorithm 1) -----------------


def scheduled_width(confidences: list[list[float]], costs: StepCosts, counts: list[int] | None = None,
                    early_stop: bool = True) -> int:
    """`worthwhile_width` of hand-set confidences [N][P], every row free to keep P + 1 tokens unless `counts`."""
    rows = torch.tensor(confidences)
    counts = [rows.shape[1] + 1] * rows.shape[0] if counts is None else counts
    return worthwhile_width(rows, counts, costs, early_stop=early_stop)


def test_the_schedule_widens_while_expected_tokens_per_second_rise():
    """Algorithm 1 on hand-set curves: expected tokens 1 + the running products of the confidences, over the step's
    seconds; the first widening that does not pay (a tie included) ends the search, even where a wider verify
    further on would pay again (a cliff in the curve: the paper's unimodal assumption)."""
    costs = StepCosts(draft=0.5, verify=(1.0, 1.2, 1.5, 2.0, 2.1))
    expected = [1.0, 1.9, 1.9 + 0.72, 1.9 + 0.72 + 0.36, 1.9 + 0.72 + 0.36 + 0.324]  # products 0.9, 0.72, 0.36, ...
    rates = [tokens / (0.5 + seconds) for tokens, seconds in zip(expected, costs.verify)]
    assert rates[2] > rates[1] > rates[0] and rates[3] < rates[2]
    assert scheduled_width([[0.9, 0.8, 0.5, 0.9]], costs) == 3
    cliff = StepCosts(draft=0.0, verify=(1.0, 1.5, 3.5, 3.6, 3.7))  # rates 1, 1.33, 0.86, 1.11, 1.35
    assert scheduled_width([[1.0] * 4], cliff) == 2
    assert scheduled_width([[1.0] * 4], cliff, early_stop=False) == 5  # the search over all widths goes past it
    flat = StepCosts(draft=0.0, verify=(1.0,) * 5)
    assert scheduled_width([[0.5, 0.0, 1.0, 1.0]], flat) == 2  # a zero product adds nothing: a tie, the end
    assert scheduled_width([[0.1] * 4], flat) == 5 and scheduled_width([[0.0] * 4], flat) == 1


def test_a_batch_schedules_one_width_from_the_sum_of_its_rows():
    """The batch verifies one rectangle: widening admits every row's next proposal, for the sum of the rows' products
    there; a row that max_new_tokens stops adds nothing past its count."""
    costs = StepCosts(draft=0.0, verify=(1.0, 1.4, 1.8))
    sure, unsure = [1.0, 1.0], [0.1, 0.1]
    assert scheduled_width([sure], costs) == 3 and scheduled_width([unsure], costs) == 1
    assert scheduled_width([sure, unsure], costs) == 3  # rates 2, 2.36, 2.23 ... then 3.01 / 1.8 = 1.67 ...
    assert scheduled_width([unsure, unsure, unsure], costs) == 1
    assert scheduled_width([sure, sure], costs, counts=[2, 2]) == 2  # neither row can keep a third token


def test_the_early_stop_never_reads_past_the_first_proposal_it_drops():
    """Whether proposal k is verified never depends on a confidence at a later position (those follow proposal k's
    own token in a DSpark draft): the paper's Appendix A. With its numbers, a search over every width admits the
    first proposal or not by the second confidence (which the first token shaped); the early stop does not."""
    for second in (0.9, 0.0):
        assert scheduled_width([[0.8, second]], APPENDIX_A) == 1  # 1.8 * 0.5 = 0.9 < 1.0: stop before reading c2
    assert scheduled_width([[0.8, 0.9]], APPENDIX_A, early_stop=False) == 3  # 2.52 * 0.45 = 1.134
    assert scheduled_width([[0.8, 0.0]], APPENDIX_A, early_stop=False) == 1
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        rows, positions = 1 + case % 4, 1 + case % 7
        confidences = torch.rand(rows, positions, generator=generator) ** 0.3
        verify = (1.0 + torch.rand(positions + 1, generator=generator).cumsum(0) * 0.4).tolist()
        costs = StepCosts(draft=float(torch.rand(1, generator=generator)), verify=tuple(verify))
        counts = torch.randint(1, positions + 2, (rows,), generator=generator).tolist()
        width = worthwhile_width(confidences, counts, costs, early_stop=True)
        changed = confidences.clone()
        changed[:, width:] = torch.rand(rows, positions, generator=generator)[:, width:].round()  # 0s and 1s
        assert worthwhile_width(changed, counts, costs, early_stop=True) == width, case


def scheduled_draft(variant: str, tmp_path: Path, target: torch.nn.Module) -> DFlashDraftModel:
    """A golden DSpark draft (its Markov head planted with the golden target's bigram, so proposals get accepted)."""
    record = GOLDEN_RECORD["variants"][variant]
    return DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / variant, record["config"], record["shapes"], target, record["seed"]))


class ScheduleRecordingProposer(DFlashProposer):
    """Records each step's rows, the confidences the proposer gave (with their flag) and each row's count."""

    def __init__(self, *args, max_new_tokens: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_new_tokens = max_new_tokens
        self.steps: list[tuple[list[int], torch.Tensor, list[int]]] = []

    def propose(self, step):
        proposal = super().propose(step)
        assert proposal.sequential_confidences
        counts = [min(step.block_size, self.max_new_tokens - len(tokens)) for tokens in step.generated]
        self.steps.append((list(step.row_ids), proposal.confidences, counts))
        return proposal


@pytest.mark.parametrize("variant", ["dspark_vanilla", "dspark_gated", "dspark_rnn"])
def test_auto_verifies_the_scheduled_width_of_the_confidence_heads_products(tmp_path, variant):
    """In the loop, batch 1 and a left-padded batch of 3: each step verifies the width Algorithm 1 gives for the
    confidence head's sigmoids (`test_auto_scores_each_proposal_with_the_confidence_heads_sigmoid`), with its early
    stop (on the third curve some steps' widths differ from a search over all widths), and each row equals the
    target's greedy decode."""
    target = golden_target()
    draft = scheduled_draft(variant, tmp_path, target)
    prompts = golden_prompts()
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    widths_by_curve, searched_further = [], 0
    for costs in SCHEDULE_COSTS:
        widths_by_curve.append(set())
        for batch, mask in [(prompts[1], None), (input_ids, attention_mask)]:
            proposer = ScheduleRecordingProposer(draft, target, draft.mask_token_id, confidence_threshold="auto",
                                                 max_new_tokens=20)
            result = speculative_decode(target, proposer, batch, attention_mask=mask, max_new_tokens=20,
                                        block_size=draft.block_size, stop_token_ids=[], step_costs=costs)
            seen = {row: 0 for row in range(batch.shape[0])}
            for rows, confidences, counts in proposer.steps:
                width = worthwhile_width(confidences, counts, costs, early_stop=True)
                searched_further += worthwhile_width(confidences, counts, costs) != width
                for row in rows:
                    assert result.verified_lengths[row][seen[row]] == width
                    seen[row] += 1
            rows_of = [prompts[1]] if mask is None else prompts
            for row, ids in enumerate(rows_of):
                assert result.new_tokens(row) == plain_greedy(target, ids, 20)[0, ids.shape[1]:].tolist(), row
            assert max(length for lengths in result.acceptance_lengths for length in lengths) >= 2
            widths_by_curve[-1] |= {width for widths in result.verified_lengths for width in widths}
    assert all(len(widths) >= 2 for widths in widths_by_curve[:2])  # the cut moves with the confidences
    assert max(widths_by_curve[0]) > max(widths_by_curve[1])  # and with the curve
    assert searched_further > 0


def test_auto_scores_each_proposal_with_the_confidence_heads_sigmoid():
    """A head planted to read only W1 of the token before (W1 the identity): position k's confidence is
    sigmoid(w[token before k]), the pending token before the first."""
    target = build_target("qwen3")
    draft = deepspec_draft("vanilla", seed=2, markov_rank=VOCAB_SIZE)
    weights = torch.linspace(-3.0, 3.0, VOCAB_SIZE)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB_SIZE))
        draft.confidence_head.proj.weight.zero_()
        draft.confidence_head.proj.bias.zero_()
        draft.confidence_head.proj.weight[0, -VOCAB_SIZE:] = weights
    proposer = ScheduleRecordingProposer(draft, target, draft.mask_token_id, confidence_threshold="auto",
                                         max_new_tokens=12)
    recorder = RecordingProposer(draft, target, draft.mask_token_id)  # the same greedy proposals, recorded
    input_ids = random_prompt(9, 6)
    speculative_decode(target, proposer, input_ids, max_new_tokens=12, block_size=draft.block_size,
                       step_costs=StepCosts(0.0, (1.0,) * 8))
    speculative_decode(target, recorder, input_ids, max_new_tokens=12, block_size=draft.block_size)
    first = plain_greedy(target, input_ids, 1)[0, -1].item()
    tokens = [first, *recorder.steps[0][0].tolist()]
    confidences = proposer.steps[0][1][0]
    torch.testing.assert_close(confidences, weights[tokens[: confidences.shape[0]]].sigmoid())


def test_auto_runs_on_the_step_costs_the_cost_model_measures(tmp_path):
    """The curve `cost_model.measure_verify_costs` times here (at the batch's size) drives the schedule; each row of
    a left-padded batch still equals the target's greedy decode."""
    from dflash_hf.cost_model import measure_verify_costs

    target = golden_target()
    draft = scheduled_draft("dspark_vanilla", tmp_path, target)
    prompts = golden_prompts()
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    costs = measure_verify_costs(draft, target, prompts[1], draft.mask_token_id, repeats=1, batch_size=3)
    assert len(costs.verify) == draft.block_size
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=16, confidence_threshold="auto", step_costs=costs, return_stats=True)
    for row, ids in enumerate(prompts):
        assert result.new_tokens(row) == plain_greedy(target, ids, 16)[0, ids.shape[1]:].tolist(), row


def test_auto_runs_through_generate_and_is_refused_where_it_cannot_apply(tmp_path):
    target = golden_target()
    draft = scheduled_draft("dspark_gated", tmp_path, target)
    input_ids = golden_prompts()[0]
    draft.save_pretrained(tmp_path / "saved")  # with custom_generate/generate.py
    through_generate = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                       custom_generate=str(tmp_path / "saved"), trust_remote_code=True,
                                       assistant_model=draft, max_new_tokens=16, do_sample=False, pad_token_id=0,
                                       confidence_threshold="auto", step_costs=SCHEDULE_COSTS[0])
    assert torch.equal(through_generate, plain_greedy(target, input_ids, 16))
    with pytest.raises(ValueError, match="step_costs=dflash_hf.cost_model.measure_verify_costs"):
        draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=8, confidence_threshold="auto")
    with pytest.raises(ValueError, match="step_costs"):  # a proposer handed to the loop directly, without costs
        speculative_decode(target, DFlashProposer(draft, target, draft.mask_token_id, confidence_threshold="auto"),
                           input_ids, max_new_tokens=8, block_size=draft.block_size)
    with pytest.raises(ValueError, match="or 'auto'"):
        draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=8, confidence_threshold="best")
    with pytest.raises(ValueError, match="confidence head"):
        deepspec_draft("dflash").spec_generate(target=build_target("qwen3"), input_ids=random_prompt(3, 4),
                                               max_new_tokens=8, confidence_threshold="auto",
                                               step_costs=StepCosts(0.0, (1.0,) * 8))
    with pytest.raises(ValueError, match="tree_size"):
        draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=8, confidence_threshold="auto",
                            tree_size=4)


# a head whose confidence follows the token before only (after token 4: high; after 1: 0.3; else low), and a curve
# on which a row whose first confidence is 0.3 verifies its pending token alone, while one that searched past that
# (the retrospective search) would verify more exactly when its first draw leads to a confident second position
SAMPLED_CONFIDENCE = (0.02, 0.3, 0.02, 0.02, 0.97, 0.02)
SAMPLED_COSTS = StepCosts(draft=0.0, verify=(1.0, 1.5, 1.55, 1.6))


def scheduled_sampling_draft(target: torch.nn.Module) -> DFlashDraftModel:
    """A vanilla DSpark draft over the sampling target's 6 tokens: its Markov head planted with the target's likely
    next token (after 1: 4, after 4: 1), its confidence head reading W1 of the token before only
    (`SAMPLED_CONFIDENCE`)."""
    draft = deepspec_draft("vanilla", seed=12, block_size=3, vocab_size=VOCAB, markov_rank=VOCAB)
    with torch.no_grad():
        following = target(torch.arange(VOCAB)[:, None]).logits[:, -1].argmax(-1)  # [V]
        following[1], following[4] = 4, 1
        draft.norm.weight.mul_(0.05)  # small LM-head logits: the bias counts
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        draft.markov_head.markov_w2.weight.copy_(2.0 * torch.eye(VOCAB)[following].T)
        head = draft.confidence_head.proj
        head.weight.zero_()
        head.bias.zero_()
        head.weight[0, -VOCAB:] = torch.logit(torch.tensor(SAMPLED_CONFIDENCE))
    return draft


@pytest.mark.parametrize("rows", [1000, 5])
def test_sampled_scheduled_chains_follow_the_target_distribution(rows):
    """confidence_threshold="auto" at temperature 0.9, in one call of 1000 rows and in calls of 5 (where one row's
    draws move the batch's width): chi-square over the first 3 new tokens (5 decoded, so that a step may verify 3
    proposals), with the power check."""
    from collections import Counter

    from sampling_checks import sampling_target

    target, input_ids = sampling_target()
    draft = scheduled_sampling_draft(target)
    generator, counts, accepted = torch.Generator().manual_seed(5), Counter(), 0
    for _ in range(NUM_SAMPLES // rows):
        proposer = DFlashProposer(draft, target, VOCAB - 1, confidence_threshold="auto")
        sampled, kept = sampled_counts(target, proposer, input_ids, generator, num_samples=rows,
                                       max_new_tokens=NUM_NEW + 2, block_size=4, temperature=0.9,
                                       step_costs=SAMPLED_COSTS)
        for continuation, count in sampled.items():
            counts[continuation[:NUM_NEW]] += count
        accepted += kept
    assert accepted > NUM_SAMPLES // 10
    assert_follows(dict(counts), exact_joint(target, input_ids, 0.9, None, None),
                   exact_joint(target, input_ids, 0.9 * 1.5, None, None))
