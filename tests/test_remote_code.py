"""An exported draft loads with trust_remote_code=True where dflash_hf cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from helpers import make_draft, make_target

# argv: the draft's folder, the target's, the prompt (JSON), and optionally the block size (4 when absent)
LOAD_WITHOUT_PACKAGE = textwrap.dedent("""
    import json, sys
    sys.modules["dflash_hf"] = None  # the package is not available: only torch + transformers
    try:
        import dflash_hf
    except ImportError:
        pass
    else:
        raise SystemExit("dflash_hf was importable")
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    draft_dir, target_dir, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    block_size = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    config = AutoConfig.from_pretrained(draft_dir, trust_remote_code=True)
    draft = AutoModel.from_pretrained(draft_dir, trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    result = draft.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=20,
                                 block_size=block_size, return_stats=True)
    print(json.dumps({"ids": result.output_ids[0].tolist(), "acceptance": result.acceptance_lengths,
                      "config_class": type(config).__name__, "model_module": type(draft).__module__}))
""")


def test_exported_folder_runs_with_trust_remote_code_only(tmp_path):
    target = make_target("qwen3", seed=21)
    draft = make_draft(21, block_size=8)
    prompt = [5, 9, 2, 44, 7]
    expected = draft.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=20,
                                   block_size=4, return_stats=True)
    draft.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    script = tmp_path / "load.py"
    script.write_text(LOAD_WITHOUT_PACKAGE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "draft"), str(tmp_path / "target"), json.dumps(prompt)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote = json.loads(completed.stdout.strip().splitlines()[-1])
    assert remote["model_module"].startswith("transformers_modules")
    assert remote["config_class"] == "DFlashConfig"
    assert remote["ids"] == expected.output_ids[0].tolist()
    assert remote["acceptance"] == expected.acceptance_lengths


GOLDEN_WITHOUT_PACKAGE = textwrap.dedent("""
    import json, sys
    sys.modules["dflash_hf"] = None  # only torch + transformers
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    runs, target_dir = json.loads(sys.argv[1]), sys.argv[2]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    results = []
    for folder, prompt, threshold, max_new_tokens in runs:
        draft = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        result = draft.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                     stop_token_ids=[], confidence_threshold=threshold or None, return_stats=True)
        results.append({"ids": result.output_ids[0, len(prompt):].tolist(), "acceptance": result.acceptance_lengths[0],
                        "module": type(draft).__module__})
    print(json.dumps(results))
""")


def test_exported_deepspec_drafts_reproduce_deepspecs_golden_runs_without_the_package(tmp_path):
    """Each DeepSpec variant of the golden fixture (DFlash; DSpark vanilla, gated and rnn; thresholds 0 and 0.5),
    loaded unchanged, saved by dflash-hf and run through its exported remote code where dflash_hf cannot be
    imported: DeepSpec's own new tokens, and the acceptance per step of the in-process run (itself DeepSpec's,
    tests/test_deepspec_drafts.py)."""
    from deepspec_fixture import GOLDEN, golden_prompts, golden_target, write_deepspec_folder

    from dflash_hf import DFlashDraftModel

    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    target, prompts = golden_target(), golden_prompts()
    target.save_pretrained(tmp_path / "target")
    runs, expected = [], []
    for variant, record in golden["variants"].items():
        draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
            tmp_path / "deepspec" / variant, record["config"], record["shapes"], target, record["seed"]))
        draft.save_pretrained(tmp_path / "export" / variant)
        for run in record["greedy"]:
            prompt = prompts[run["prompt"]][0].tolist()
            local = draft.spec_generate(target=target, input_ids=torch.tensor([prompt]),
                                        max_new_tokens=golden["max_new_tokens"], stop_token_ids=[],
                                        confidence_threshold=run["threshold"] or None, return_stats=True)
            assert local.output_ids[0, len(prompt):].tolist() == run["new_tokens"], (variant, run["prompt"])
            runs.append([str(tmp_path / "export" / variant), prompt, run["threshold"], golden["max_new_tokens"]])
            expected.append((run["new_tokens"], local.acceptance_lengths[0]))
    script = tmp_path / "golden.py"
    script.write_text(GOLDEN_WITHOUT_PACKAGE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    completed = subprocess.run([sys.executable, str(script), json.dumps(runs), str(tmp_path / "target")],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(remote) == len(expected) == 21
    for (folder, prompt, threshold, _), result, (new_tokens, acceptance) in zip(runs, remote, expected):
        assert result["module"].startswith("transformers_modules"), folder
        assert result["ids"] == new_tokens, (folder, prompt, threshold)
        assert result["acceptance"] == acceptance, (folder, prompt, threshold)
