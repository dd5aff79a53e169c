"""`target.generate(custom_generate=DRAFT_FOLDER, trust_remote_code=True)` runs DFlash where dflash_hf cannot be
imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from helpers import make_char_tokenizer, make_draft, make_target

RUN_WITHOUT_PACKAGE = textwrap.dedent("""
    import json, sys
    sys.modules["dflash_hf"] = None  # only torch + transformers
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    draft_dir, target_dir = sys.argv[1], sys.argv[2]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    input_ids = torch.tensor([[0, 0, 0, 5, 9, 2], [7, 3, 11, 4, 8, 6]])  # left-padded batch of two
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False,
                  pad_token_id=0)
    plain = [target.generate(input_ids=row[mask.bool()][None], max_new_tokens=20, do_sample=False, pad_token_id=0)
             for row, mask in zip(input_ids, attention_mask)]
    batched = target.generate(custom_generate=draft_dir, trust_remote_code=True, **common)
    as_output = target.generate(custom_generate=draft_dir, trust_remote_code=True, return_dict_in_generate=True,
                                **common)

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []
        def put(self, value):
            self.tokens += value.flatten().tolist()
        def end(self):
            pass

    no_mask = target.generate(custom_generate=draft_dir, trust_remote_code=True, input_ids=input_ids,
                              max_new_tokens=20, do_sample=False,
                              pad_token_id=0)  # generate infers the mask from the pads
    stop = torch.tensor([int(plain[1][0, 6 + 5])])
    stop_common = dict(input_ids=input_ids[1:], max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=stop)
    stopped_plain = target.generate(**stop_common)
    stopped = target.generate(custom_generate=draft_dir, trust_remote_code=True, **stop_common)
    streamer = Collect()
    prompt = input_ids[1:]
    streamed = target.generate(custom_generate=draft_dir, trust_remote_code=True, input_ids=prompt,
                               max_new_tokens=12, do_sample=False, pad_token_id=0, streamer=streamer)
    draft = AutoModel.from_pretrained(draft_dir, trust_remote_code=True)
    with_assistant = target.generate(custom_generate=draft_dir, trust_remote_code=True, assistant_model=draft,
                                     **common)
    try:
        target.generate(custom_generate=draft_dir, trust_remote_code=True, num_beams=2, **common)
        refusal = None
    except ValueError as error:
        refusal = str(error)

    from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

    class BoostResidue(LogitsProcessor):  # a user's processor that reads the prefix
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[torch.arange(scores.shape[0]), (input_ids[:, -1] * 7) % scores.shape[1]] += 8.0
            return scores

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])
    processors = dict(repetition_penalty=1.3, logits_processor=LogitsProcessorList([BoostResidue()]))
    unstopped = target.generate(input_ids=input_ids[1:], max_new_tokens=20, do_sample=False, pad_token_id=0,
                                **processors)
    stop = tokenizer.decode(unstopped[0, 6 + 7 : 6 + 9].tolist())
    processed = dict(common, **processors, stop_strings=[stop], tokenizer=tokenizer, output_scores=True,
                     return_dict_in_generate=True)
    processed_plain = target.generate(**processed)
    processed_ours = target.generate(custom_generate=draft_dir, trust_remote_code=True, **processed)
    drafted_all = target.generate(custom_generate=draft_dir, trust_remote_code=True, draft_processors="all",
                                  **processed)  # the draft sees the user's processor too: the same output
    processed_alone = [target.generate(**dict(processed, input_ids=row[mask.bool()][None],
                                                attention_mask=None)).sequences[0].tolist()
                       for row, mask in zip(input_ids, attention_mask)]
    scores_match = all(torch.allclose(ours[1], theirs[1], atol=1e-5)  # row 1's, up to where it stopped
                       for ours, theirs in list(zip(processed_ours.scores, processed_plain.scores))[
                           : len(processed_alone[1]) - 6])
    print(json.dumps({
        "plain": [row[0].tolist() for row in plain],
        "batched": batched.tolist(), "as_output": as_output.sequences.tolist(),
        "output_class": type(as_output).__name__,
        "streamed": streamed[0].tolist(), "stream": streamer.tokens, "with_assistant": with_assistant.tolist(),
        "refusal": refusal,
        "no_mask": no_mask.tolist(), "stopped": stopped.tolist(), "stopped_plain": stopped_plain.tolist(),
        "processed_alone": processed_alone, "processed_ours": processed_ours.sequences.tolist(),
        "processed_class": type(processed_ours).__name__, "scores_match": scores_match,
        "drafted_all": drafted_all.sequences.tolist(),
        "num_scores": len(processed_ours.scores),
    }))
""")


def test_generate_with_custom_generate_runs_our_loop_without_the_package(tmp_path):
    target, draft = make_target("qwen3", seed=31), make_draft(31, block_size=6)
    draft.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    make_char_tokenizer().save_pretrained(tmp_path / "tokenizer")
    assert (tmp_path / "draft" / "custom_generate" / "generate.py").read_text().startswith("# Exported by dflash-hf")
    (tmp_path / "run.py").write_text(RUN_WITHOUT_PACKAGE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    completed = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "draft"),
                                str(tmp_path / "target"), str(tmp_path / "tokenizer")],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    # row for row, what plain greedy generate gives each prompt alone (the batch is left-padded)
    assert result["batched"][0][3:] == result["plain"][0] and result["batched"][0][:3] == [0, 0, 0]
    assert result["batched"][1] == result["plain"][1]
    assert result["as_output"] == result["batched"] and result["output_class"] == "GenerateDecoderOnlyOutput"
    assert result["with_assistant"] == result["batched"]
    assert result["streamed"] == result["plain"][1][:6 + 12]
    assert result["stream"][-12:] == result["streamed"][6:]  # the streamer saw every new token, in order
    assert "num_beams=2" in result["refusal"]
    assert result["no_mask"] == result["batched"]  # a left-padded batch without a mask: pads are not prompt tokens
    assert result["stopped"] == result["stopped_plain"] and len(result["stopped"][0]) < 6 + 20  # a tensor EOS stops
    # generate's processors, a user's processor, a stop string and scores pass through: each row as generate gives
    # it alone (row 1 meets its stop string), scores as generate's (row 1, the unpadded one)
    assert result["processed_class"] == "GenerateDecoderOnlyOutput" and result["scores_match"]
    alone = result["processed_alone"]
    assert len(alone[1]) < 6 + 20
    assert result["processed_ours"][0][3:][: len(alone[0])] == alone[0]
    assert result["processed_ours"][1][: len(alone[1])] == alone[1]
    assert result["num_scores"] == max(len(alone[0]) + 3, len(alone[1])) - 6
    assert result["drafted_all"] == result["processed_ours"]  # draft_processors passes through generate


def test_the_standalone_copy_agrees_with_the_package_function():
    """custom_generate/generate.py is loaded alone (no sibling files), so it carries its own `embedding_device`; it
    must answer as `devices_dflash.execution_device` does."""
    from types import SimpleNamespace

    from dflash_hf.custom_generate_dflash import embedding_device
    from dflash_hf.devices_dflash import execution_device

    plain = torch.nn.Embedding(4, 2)
    dispatched = torch.nn.Embedding(4, 2)
    dispatched._hf_hook = SimpleNamespace(execution_device="cpu")
    sequential = torch.nn.Embedding(4, 2)
    sequential._hf_hook = SimpleNamespace(hooks=[SimpleNamespace(execution_device=None),
                                                 SimpleNamespace(execution_device="cpu")])
    for module in (plain, dispatched, sequential):
        assert embedding_device(module) == execution_device(module)
