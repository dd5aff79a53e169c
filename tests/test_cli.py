"""`dflash-hf train` end to end on a tiny target: data, training, Hub-ready draft with a card, tau."""

from __future__ import annotations

import json

from transformers import AutoModel

from dflash_hf.cli import main
from helpers import make_target, make_tokenizer


def test_train_command_writes_a_hub_ready_draft(tmp_path):
    target, tokenizer = make_target("llama", seed=3), make_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"w{10 + i} w{20 + i} w{30 + i}"}) for i in range(6)))
    run = tmp_path / "run"
    argv = ["train", "--target", str(tmp_path / "target"), "--output", str(run), "--prompts", str(prompts),
            "--num-prompts", "4", "--gen-batch-size", "2", "--gen-max-new-tokens", "12", "--block-size", "4",
            "--draft-layers", "1", "--mask-token", "w127", "--epochs", "2", "--num-anchors", "6", "--distill",
            "--init-from-target",
            "--eval-prompts", str(prompts), "--num-eval", "2", "--eval-max-new-tokens", "10", "--eval-dtype", "float32"]
    main(argv)
    assert len((run / "responses.jsonl").read_text().splitlines()) == 4
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["lossless"] is True and evaluation["num_prompts"] == 2 and evaluation["tau"] >= 1.0
    card = (run / "draft" / "README.md").read_text()
    assert "base_model:" in card and "dflash-hf train" in card and "tau" in card
    config = json.loads((run / "draft" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == 127 and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [2]  # one draft layer: [N // 2]
    draft = AutoModel.from_pretrained(run / "draft", trust_remote_code=True)
    assert type(draft).__name__ == "DFlashDraftModel"
    # a second run resumes: nothing is regenerated or retrained
    main(argv)
    assert json.loads((run / "training_log.json").read_text())["steps"] == 8
