"""What users do to a target between and around calls keeps the output the target's own: weights edited and hooks
or patches added after a first call, stop ids as tensors or numpy scalars, tiny temperatures, several threads; and the
command line refuses what it cannot do by name, before any work is lost."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from helpers import make_draft, make_target, plain_greedy, random_prompt, save_tiny_target_and_prompts
from transformers import Qwen3ForCausalLM

from dflash_hf import kernels_dflash
from dflash_hf.cli import main
from dflash_hf.settings_dflash import StepCosts

needs_onednn = pytest.mark.skipif(not kernels_dflash.HAS_ONEDNN_LINEAR, reason="this torch build has no oneDNN linear")
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def models():
    return make_target("qwen3", seed=5), make_draft(5, block_size=4)


def spec(draft, target, prompt, **kwargs) -> torch.Tensor:
    return draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=NEW_TOKENS, **kwargs)


# --- Edits between calls -------------------------------------------------------------------------------------------


@needs_onednn
def test_one_lm_head_row_edited_after_a_first_call_is_verified_with_its_new_values(monkeypatch):
    # a real vocabulary's head: the shape oneDNN's packed weights win on (forced here, whatever this machine times)
    monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})
    monkeypatch.setattr(kernels_dflash, "fastest_kernel", lambda weight, bias, states: "onednn")
    vocab_size = 49152
    target, draft = (make_target("qwen3", seed=4, vocab_size=vocab_size),
                     make_draft(4, block_size=4, vocab_size=vocab_size))
    prompt = random_prompt(4, 6, vocab_size)
    before = spec(draft, target, prompt)
    assert torch.equal(before, plain_greedy(target, prompt, NEW_TOKENS))
    boosted, displaced = 7, int(before[0, prompt.shape[1] + 3])
    with torch.no_grad():
        target.lm_head.weight.data[boosted] = 4 * target.lm_head.weight.data[displaced]  # one row: "boost a token"
    expected = plain_greedy(target, prompt, NEW_TOKENS)
    assert not torch.equal(expected, before)  # the edit changes the target's own output
    assert torch.equal(spec(draft, target, prompt), expected)


def favour_token(token: int):
    """A forward hook adding a logit bias to `token` (what a user adds to steer a model)."""
    def hook(module, args, output):
        output.logits[..., token] += 3.0
        return output
    return hook


def head_bias(token: int):
    def hook(module, args, output):
        return output + 3.0 * torch.nn.functional.one_hot(torch.tensor(token), output.shape[-1]).to(output)
    return hook


INTERVENTIONS = {
    "forward hook on the causal LM": lambda target, token, monkeypatch: target.register_forward_hook(
        favour_token(token)),
    "forward hook on the head": lambda target, token, monkeypatch: target.lm_head.register_forward_hook(
        head_bias(token)),
    "global forward hook": lambda target, token, monkeypatch: torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: favour_token(token)(module, args, output) if module is target else output),
    "instance forward patched": lambda target, token, monkeypatch: monkeypatch.setattr(
        target, "forward", lambda *a, _forward=target.forward, **k: favour_token(token)(target, a, _forward(*a, **k))),
    "class forward patched": lambda target, token, monkeypatch: monkeypatch.setattr(
        Qwen3ForCausalLM, "forward",
        lambda self, *a, _forward=Qwen3ForCausalLM.forward, **k: favour_token(token)(
            self, a, _forward(self, *a, **k))),
}


@pytest.mark.parametrize("intervention", INTERVENTIONS)
def test_a_hook_or_patch_added_after_a_first_call_shapes_every_verify(intervention, monkeypatch):
    target, draft = make_target("qwen3", seed=6), make_draft(6, block_size=4)
    prompt = random_prompt(6, 7)
    before = spec(draft, target, prompt)  # the head fast path is taken and probed
    favoured = int(before[0, -1])
    handle = INTERVENTIONS[intervention](target, favoured, monkeypatch)
    try:
        expected = plain_greedy(target, prompt, NEW_TOKENS)
        assert not torch.equal(expected, before)
        assert torch.equal(spec(draft, target, prompt), expected)
    finally:
        if handle is not None:
            handle.remove()
    monkeypatch.undo()
    assert torch.equal(spec(draft, target, prompt), before)  # and taken away again


# --- Stop ids in every form generate takes ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["tensor", "0-d tensor", "numpy scalar", "numpy array", "list of 0-d tensors",
                                  "generation config tensor"])
def test_stop_ids_as_tensors_or_numpy_are_honoured(form, models):
    target, draft = models
    prompt = random_prompt(8, 6)
    stop = int(plain_greedy(target, prompt, NEW_TOKENS)[0, prompt.shape[1] + 5])
    expected = plain_greedy(target, prompt, NEW_TOKENS, stop_token_ids=[stop])
    assert expected.shape[1] < prompt.shape[1] + NEW_TOKENS  # it stops
    given = {"tensor": torch.tensor([stop]), "0-d tensor": torch.tensor(stop), "numpy scalar": np.int64(stop),
             "numpy array": np.array([stop]), "list of 0-d tensors": [torch.tensor(stop)]}
    if form == "generation config tensor":
        saved = target.generation_config.eos_token_id
        target.generation_config.eos_token_id = torch.tensor([stop])
        try:
            output = spec(draft, target, prompt)
        finally:
            target.generation_config.eos_token_id = saved
    else:
        output = spec(draft, target, prompt, stop_token_ids=given[form])
    assert torch.equal(output, expected)


@pytest.mark.parametrize("stop_token_ids,message", [
    (["w1"], "holds the string 'w1': pass token ids"),
    ([[1, 2]], "flat list of token ids"),
    (torch.tensor([[1, 2]]), "1-d integer tensor"),
    (torch.tensor([1.0]), "integer token ids"),
    ([1.5], "integer token ids"),
])
def test_stop_ids_that_are_not_token_ids_are_refused_by_name(stop_token_ids, message, models):
    target, draft = models
    with pytest.raises(TypeError, match=message):
        spec(draft, target, random_prompt(8, 6), stop_token_ids=stop_token_ids)


# --- Temperatures at the edge ----------------------------------------------------------------------------------------


def test_a_vanishing_temperature_samples_the_greedy_tokens(models):
    target, draft = models
    prompt = random_prompt(9, 6)
    output = spec(draft, target, prompt, temperature=1e-40, seed=0)
    assert torch.equal(output, plain_greedy(target, prompt, NEW_TOKENS))  # not NaN probabilities, not the mask id


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -float("inf")])
def test_a_temperature_that_is_not_a_finite_number_is_refused(temperature, models):
    target, draft = models
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        spec(draft, target, random_prompt(9, 6), temperature=temperature)


def test_step_costs_that_are_not_finite_are_refused():
    for draft_seconds, verify in [(float("nan"), (1.0,)), (0.1, (float("inf"),)), (0.1, (1.0, float("nan")))]:
        with pytest.raises(ValueError, match="finite"):
            StepCosts(draft=draft_seconds, verify=verify)


# --- Threads ---------------------------------------------------------------------------------------------------------


def run_in_threads(calls: list) -> list:
    """Each call in its own thread, switching between threads as often as Python allows; their results in order."""
    results, errors = [None] * len(calls), []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as error:  # reported by the test
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    return results


def test_threads_decoding_with_one_target_each_get_the_targets_own_output():
    target = make_target("qwen3", seed=10)
    drafts = [make_draft(10, block_size=4), make_draft(11, block_size=3)]
    prompts = [random_prompt(10, 5), random_prompt(11, 9)]
    expected = [plain_greedy(target, prompt, NEW_TOKENS) for prompt in prompts]
    calls = [lambda index=index: [spec(drafts[index], target, prompts[index]) for _ in range(3)] for index in range(2)]
    for outputs, wanted in zip(run_in_threads(calls), expected):
        assert all(torch.equal(output, wanted) for output in outputs)


def test_threads_decoding_with_different_targets_each_get_their_targets_output():
    pairs = [(make_target("qwen3", seed=seed), make_draft(seed, block_size=4)) for seed in (12, 13)]
    prompt = random_prompt(12, 6)
    expected = [plain_greedy(target, prompt, NEW_TOKENS) for target, _ in pairs]
    calls = [lambda target=target, draft=draft: [spec(draft, target, prompt) for _ in range(3)]
             for target, draft in pairs]
    for outputs, wanted in zip(run_in_threads(calls), expected):
        assert all(torch.equal(output, wanted) for output in outputs)


# --- The command line refuses by name, before work is lost -----------------------------------------------------------


def test_convert_to_an_existing_file_is_refused(tmp_path):
    make_draft(0).save_pretrained(tmp_path / "draft")
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit, match="is an existing file; pass a folder"):
        main(["convert", str(tmp_path / "draft"), str(tmp_path / "taken"), "--to", "transformers"])


def test_convert_from_a_missing_or_damaged_folder_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="No draft folder at"):
        main(["convert", str(tmp_path / "absent"), str(tmp_path / "out"), "--to", "transformers"])
    make_draft(0).save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SystemExit, match="the weights file is damaged"):  # read before any native class is needed
        main(["convert", str(tmp_path / "draft"), str(tmp_path / "out"), "--to", "dflash"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no config.json"):
        main(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--to", "transformers"])


def test_from_pretrained_of_a_missing_local_folder_names_it(tmp_path):
    from dflash_hf import DFlashDraftModel

    with pytest.raises(FileNotFoundError, match="No draft folder at"):
        DFlashDraftModel.from_pretrained(tmp_path / "absent")


TRAIN = ["--num-prompts", "3", "--gen-batch-size", "3", "--gen-max-new-tokens", "8", "--draft-block-size", "4",
         "--draft-layers", "1", "--mask-token", "w127", "--epochs", "1", "--num-anchors", "4"]


def test_train_without_evaluation_writes_the_draft(tmp_path):
    prompts = save_tiny_target_and_prompts(tmp_path, 4)
    run = tmp_path / "run"
    main(["train", "--target", str(tmp_path / "target"), "--output", str(run), "--prompts", str(prompts), *TRAIN,
          "--num-eval", "0"])
    assert (run / "draft" / "model.safetensors").is_file() and (run / "draft" / "README.md").is_file()
    assert not (run / "evaluation.json").exists()


@pytest.mark.parametrize("content,message", [
    ("", "holds no prompts to evaluate on"),
    ('{"question": "w5 w6"}\n{"question": ', r"eval\.jsonl:2: not a JSON object"),
])
def test_train_with_an_unusable_eval_file_stops_before_training(content, message, tmp_path):
    prompts = save_tiny_target_and_prompts(tmp_path, 4)
    (tmp_path / "eval.jsonl").write_text(content)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=message):
        main(["train", "--target", str(tmp_path / "target"), "--output", str(run), "--prompts", str(prompts), *TRAIN,
              "--eval-prompts", str(tmp_path / "eval.jsonl"), "--num-eval", "2"])
    assert not (run / "responses.jsonl").exists()  # nothing was generated or trained


@pytest.mark.parametrize("content,message", [("", "hold no prompts"), ('{"turns": 3}\n', r"prompts\.jsonl:1")])
def test_train_with_an_unusable_prompts_file_names_it(content, message, tmp_path):
    save_tiny_target_and_prompts(tmp_path, 1)
    (tmp_path / "prompts.jsonl").write_text(content)
    with pytest.raises(SystemExit, match=message):
        main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"),
              "--prompts", str(tmp_path / "prompts.jsonl"), *TRAIN, "--num-eval", "0"])


@pytest.mark.parametrize("flag", ["--num-prompts", "--max-new-tokens"])
def test_bench_with_nothing_to_measure_is_refused(flag):
    with pytest.raises(SystemExit, match=f"{flag} must be >= 1"):
        main(["bench", flag, "0"])


def test_push_without_a_token_stops_before_the_network(tmp_path, monkeypatch):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("push went to the network")

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub, "HfApi", no_network)
    make_draft(0).save_pretrained(tmp_path / "draft")
    with pytest.raises(SystemExit, match="No Hugging Face token"):
        main(["push", str(tmp_path / "draft"), "--repo-id", "someone/draft"])


def test_push_names_the_users_folder_when_it_is_not_hub_ready(tmp_path):
    folder = tmp_path / "my-draft"
    make_draft(0).save_pretrained(folder)
    for name in ("modeling_dflash.py", "README.md"):
        (folder / name).unlink(missing_ok=True)  # not exported: push stages a copy and checks that
    with pytest.raises(SystemExit, match=f"{folder} is not Hub-ready: missing README.md"):
        main(["push", str(folder), "--repo-id", "someone/draft", "--dry-run"])

