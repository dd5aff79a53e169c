"""Reliability fixes: strict loading, versioned exports, hooked / offloaded heads, rope for every reader, the verify
fast path chosen by what a target exposes."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import draft_config, make_draft, make_target, plain_greedy
from safetensors.torch import load_file, save_file
from transformers import AutoModel, Qwen3ForCausalLM

import dflash_hf.kernels_dflash as kernels_dflash
import dflash_hf.target_dflash as target_dflash
from dflash_hf import DFLASH_HF_VERSION, DFlashConfig, DFlashDraftModel
from dflash_hf.configuration_dflash import REMOTE_CODE_FILES, read_rope_parameters
from dflash_hf.demo import SHIPPED_DRAFT
from dflash_hf.kernels_dflash import cpu_kernels, few_row_logits
from dflash_hf.push import check_hub_folder, differing_remote_code
from dflash_hf.target_dflash import plain_head_parts


@pytest.mark.parametrize("folder", ["shipped", "shipped v7", "written"])
def test_every_draft_folder_loads_as_the_dflash_draft(folder, tmp_path):
    path = {"shipped": SHIPPED_DRAFT, "shipped v7": SHIPPED_DRAFT.with_name(SHIPPED_DRAFT.name + "-v7")}.get(
        folder, tmp_path / "draft")
    if folder == "written":
        make_draft(1).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    assert all((path / name).exists() for name in REMOTE_CODE_FILES)
    remote = AutoModel.from_pretrained(path, trust_remote_code=True)
    local = DFlashDraftModel.from_pretrained(path)
    assert type(remote).__name__ == "DFlashDraftModel" and type(remote).__module__.startswith("transformers_modules")
    assert remote.state_dict().keys() == local.state_dict().keys()
    assert all(torch.equal(remote.state_dict()[name], tensor) for name, tensor in local.state_dict().items())
    # the folder's remote code is the package's own (the shipped folder links to the package's modules)
    assert differing_remote_code(path) == []


@pytest.mark.parametrize("damage", ["missing", "unexpected", "target checkpoint"])
def test_loading_that_would_drop_weights_fails_loudly(damage, tmp_path):
    make_draft(2).save_pretrained(tmp_path / "draft")
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    if damage == "missing":
        del weights["fc.weight"]
    elif damage == "unexpected":
        weights["embed_tokens.weight"] = torch.zeros(4, 4)
    if damage == "target checkpoint":  # a plain Qwen3 checkpoint is no DFlash draft
        make_target("qwen3").save_pretrained(tmp_path / "target")
        (tmp_path / "draft" / "model.safetensors").write_bytes(
            (tmp_path / "target" / "model.safetensors").read_bytes())
    else:
        save_file(weights, tmp_path / "draft" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="do not match a DFlash draft"):
        DFlashDraftModel.from_pretrained(tmp_path / "draft")


def test_exports_carry_the_version_and_push_refuses_other_remote_code(tmp_path):
    folder = tmp_path / "draft"
    make_draft(3).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dflash_hf_version"] == DFLASH_HF_VERSION
    for name in REMOTE_CODE_FILES:
        assert (folder / name).read_text().splitlines()[0].startswith(f"# Exported by dflash-hf {DFLASH_HF_VERSION}")
    make_draft(3).save_pretrained(folder)  # saving again keeps one header line
    assert sum(line.startswith("# Exported by")
               for line in (folder / "modeling_dflash.py").read_text().splitlines()) == 1
    assert differing_remote_code(folder) == []
    (folder / "README.md").write_text("---\nbase_model: x\nlibrary_name: transformers\npipeline_tag: text-generation\n"
                                      "license: apache-2.0\ntags: [dflash]\n---\ncard\n")
    check_hub_folder(folder)
    with open(folder / "sampling_dflash.py", "a") as handle:
        handle.write("# edited by hand\n")
    with pytest.raises(ValueError, match="sampling_dflash.py differs from the installed dflash-hf"):
        check_hub_folder(folder)
    assert "sampling_dflash.py" in check_hub_folder(folder, keep_remote_code=True)


def test_few_row_logits_calls_a_hooked_or_offloaded_head():
    from accelerate import cpu_offload

    torch.manual_seed(0)
    head, states = torch.nn.Linear(16, 40, bias=False), torch.randn(3, 16)
    expected = head(states)
    calls = []
    hook = head.register_forward_hook(lambda module, inputs, output: calls.append(1))
    torch.testing.assert_close(few_row_logits(head, states), expected)
    assert calls == [1]  # the hook ran: the head was called, not bypassed
    hook.remove()
    cpu_offload(head, execution_device="cpu")  # Accelerate: the weight lives on `meta`, a hook loads it per call
    assert head.weight.device.type == "meta"
    torch.testing.assert_close(few_row_logits(head, states), expected)


def test_an_offloaded_target_head_stays_lossless():
    from accelerate import cpu_offload

    target, draft = make_target("qwen3", seed=4), make_draft(4)
    prompt = torch.tensor([[5, 9, 2, 44, 7]])
    expected = plain_greedy(target, prompt, 16)
    cpu_offload(target.lm_head, execution_device="cpu")
    assert plain_head_parts(target) is None  # the head's forward is Accelerate's: no fast path
    assert torch.equal(draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=16, block_size=4), expected)


class SubclassedQwen3(Qwen3ForCausalLM):
    """A subclass whose logits are still exactly lm_head(base(...)): it gets the fast path."""


class ScaledLogitsQwen3(Qwen3ForCausalLM):
    """A target whose forward scales its logits (as Cohere or Granite do): never the fast path."""

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        outputs.logits = (outputs.logits * 0.5
                          - torch.arange(outputs.logits.shape[-1], dtype=outputs.logits.dtype) * 0.01)
        return outputs


@pytest.mark.parametrize("target_class, fast", [(Qwen3ForCausalLM, True), (SubclassedQwen3, True),
                                                (ScaledLogitsQwen3, False)])
def test_the_verify_fast_path_is_chosen_by_what_the_target_exposes(target_class, fast):
    reference = make_target("qwen3", seed=5)
    target = target_class(reference.config).eval()
    target.load_state_dict(reference.state_dict())
    assert (plain_head_parts(target) is not None) == fast
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    expected = plain_greedy(target, prompt, 20)
    assert torch.equal(make_draft(5).spec_generate(target=target, input_ids=prompt, max_new_tokens=20), expected)


def test_a_target_is_probed_once(monkeypatch):
    target = make_target("llama", seed=6)
    calls = []
    monkeypatch.setattr(target_dflash, "_PLAIN_HEAD_PROBED", target_dflash.weakref.WeakKeyDictionary())
    forward = type(target).forward

    @functools.wraps(forward)  # the class's code, counted (a hook would switch the fast path off)
    def counting(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", counting)
    make_draft(6).spec_generate(target=target, input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=12, block_size=4)
    make_draft(6).spec_generate(target=target, input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=12, block_size=4)
    assert len(calls) == 2 + 1  # two prefills through the target's own forward, one probe; verifies use the base


@pytest.mark.parametrize("rope", [{"rope_theta": 100000.0},
                                  {"rope_theta": 500000.0, "rope_scaling": {
                                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}])
def test_saved_configs_carry_rope_for_every_reader(rope, tmp_path):
    """config.json holds rope_parameters and the top-level rope_theta/rope_scaling, and reads back the same."""
    make_draft(7, **rope).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == rope["rope_theta"] == saved["rope_parameters"]["rope_theta"]
    scaling = rope.get("rope_scaling")
    assert (saved["rope_scaling"] is None) == (scaling is None)
    if scaling is not None:
        assert saved["rope_scaling"]["factor"] == saved["rope_parameters"]["factor"] == scaling["factor"]
    assert read_rope_parameters(DFlashConfig.from_pretrained(tmp_path)) == read_rope_parameters(
        make_draft(7, **rope).config)
    for reader_view in ({k: v for k, v in saved.items() if k != "rope_parameters"},  # a Transformers-4 style reader
                        {k: v for k, v in saved.items() if k not in ("rope_theta", "rope_scaling")}):  # a 5.x one
        assert read_rope_parameters(DFlashConfig(**reader_view))["rope_theta"] == rope["rope_theta"]


def test_config_normalises_itself_when_loaded(tmp_path):
    published_variant = draft_config().to_dict()
    published_variant.update(block_size=None, num_target_layers=None)
    published_variant["dflash_config"] = {"block_size": 10, "mask_token": 5, "num_target_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(published_variant))
    config = DFlashConfig.from_pretrained(tmp_path)
    assert (config.block_size, config.num_target_layers) == (10, 4)
    # 2 draft layers of 4: round(1 + i * 0 / 1)
    assert config.dflash_config == {"target_layer_ids": [1, 1], "mask_token_id": 5}


def test_inv_freq_is_a_non_persistent_buffer():
    draft = make_draft(8)
    assert "rotary_emb.inv_freq" in dict(draft.named_buffers())
    assert not any("inv_freq" in name for name in draft.state_dict())


def test_rope_frequencies_stay_float32_through_dtype_casts():
    draft = make_draft(9, rope_theta=1e6)
    exact = draft.rotary_emb.inv_freq.clone()
    draft.to(torch.bfloat16)
    assert draft.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(draft.rotary_emb.inv_freq, exact)
    assert draft.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("kernel", ["linear", "transposed", pytest.param("onednn", marks=pytest.mark.skipif(
    not kernels_dflash.HAS_ONEDNN_LINEAR, reason="this torch build has no oneDNN linear kernel"))])
def test_few_row_products_equal_the_linear_layer_whichever_kernel_is_faster(kernel, monkeypatch):
    weight, bias = torch.randn(300, 24, generator=torch.Generator().manual_seed(0)), torch.randn(300)
    timed = []
    monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})
    monkeypatch.setattr(kernels_dflash, "fastest_kernel", lambda w, b, s: timed.append(s.shape[0]) or kernel)
    for rows in (1, 3, 3, 7, 3):
        states = torch.randn(rows, 24)
        with cpu_kernels():
            product = kernels_dflash.few_row_product(weight, bias, states)
        torch.testing.assert_close(product, torch.nn.functional.linear(states, weight, bias))
    assert timed == [1, 3, 7]  # each shape timed once per process, then its choice reused
    threads = torch.get_num_threads()
    assert kernels_dflash.FEW_ROW_KERNEL_CHOICE == {(torch.float32, (300, 24), rows, threads): kernel
                                                   for rows in (1, 3, 7)}
