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
