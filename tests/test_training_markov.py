"""Training DSpark drafts (DeepSpec): shifted labels, a Markov head, a confidence head, and DeepSpec's loss."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB_SIZE, make_target, plain_greedy, save_tiny_target_and_prompts
from transformers import AutoModel

from dflash_hf import DFlashDraftModel
from dflash_hf.cli import main
from dflash_hf.target_dflash import select_features
from dflash_hf.training import dflash_loss
from dflash_hf.training.objective import LossWeights, loss_decay_gamma, sample_anchors, target_signals, teacher_rows
from dflash_hf.training.recipe import dspark_config

MASK = VOCAB_SIZE - 1
BLOCK = 5  # verified tokens; DeepSpec's block_size 4: [t0, MASK x 3], every row a proposal


def dspark_draft(kind: str | None, seed: int, confidence: bool = True) -> DFlashDraftModel:
    """A tiny draft with DeepSpec's block, a Markov head of `kind` (None: none) and a confidence head."""
    from helpers import draft_config

    heads = {"shifted_labels": True, "markov_rank": 8 if kind else 0, "markov_head_type": kind,
             "enable_confidence_head": confidence, "confidence_head_with_markov": confidence and kind is not None}
    torch.manual_seed(seed)
    return DFlashDraftModel(dspark_config(draft_config(block_size=BLOCK), heads)).eval()


def test_deepspecs_block_has_one_row_fewer_every_one_a_proposal_and_a_prefix_of_labels():
    from dflash_hf.training import build_blocks

    input_ids = torch.arange(100, 120)
    loss_mask = torch.zeros(20)
    loss_mask[6:] = 1
    loss_mask[9] = 0  # a gap: labels after it in the same block no longer count (DeepSpec's eval_mask)
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([4, 17]), 4, MASK, shifted_labels=True)
    assert blocks.block_ids.tolist() == [104, MASK, MASK, 117, MASK, MASK]
    assert blocks.block_position_ids.tolist() == [4, 5, 6, 17, 18, 19]
    assert blocks.labels.tolist() == [[105, 106, 107], [118, 119, 0]]  # the same labels as a DFlash block's
    assert blocks.label_mask.tolist() == [[False, False, False], [True, True, False]]
    plain = build_blocks(input_ids, loss_mask, torch.tensor([4, 17]), 4, MASK)
    assert plain.label_mask.tolist() == [[False, True, True], [True, True, False]]


def deepspec_markov_bias(draft: DFlashDraftModel, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """DeepSpec's teacher-forced Markov bias [P, V] of one block (markov_head.py), written out from its weights."""
    head = draft.markov_head
    if head is None:  # DeepSpec's DFlash: no bias
        return torch.zeros(len(previous), VOCAB_SIZE)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V, r], [V, r]
    embedded = w1[previous]  # [P, r]
    if head.kind == "vanilla":
        return embedded @ w2.T
    if head.kind == "gated":
        gate = torch.sigmoid(torch.cat((hidden, embedded), -1) @ head.gate_proj.weight.T + head.gate_proj.bias)
        return (gate * embedded) @ w2.T
    state, biases = torch.zeros(w1.shape[1]), []
    for position in range(len(previous)):
        z = torch.cat((state, embedded[position], hidden[position])) @ head.joint_proj.weight.T + head.joint_proj.bias
        gate, candidate, output = z.chunk(3)
        state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(candidate)
        biases.append(torch.tanh(output) @ w2.T)
    return torch.stack(biases)


@pytest.mark.parametrize("kind", [None, "vanilla", "gated", "rnn"])
def test_the_dspark_loss_is_deepspecs_formula(kind):
    """CE 0.1 to the token + L1 0.9 to the target's softmax + confidence BCE 1.0 to 1 - L1/2, each position weighted
    exp(-k / gamma) over DeepSpec's prefix eval mask, all over the sum of the weights: computed block by block."""
    target, draft = make_target("qwen3", seed=6), dspark_draft(kind, seed=6)
    length = 26
    input_ids = torch.randint(0, MASK, (length,), generator=torch.Generator().manual_seed(6))
    loss_mask = torch.cat((torch.zeros(6), torch.ones(14), torch.zeros(2), torch.ones(4)))  # a gap: the prefix mask
    signals = target_signals(target, input_ids, draft.target_layer_ids, VOCAB_SIZE, teacher_rows(loss_mask))
    weights = LossWeights(l1=0.9, token_cross_entropy=True)
    result = dflash_loss(draft, target, input_ids, loss_mask, 7, torch.Generator().manual_seed(1), signals,
                         loss_weights=weights)

    anchors = sample_anchors(loss_mask, 7, torch.Generator().manual_seed(1))
    gamma = loss_decay_gamma(BLOCK)
    with torch.no_grad():
        outputs = target(input_ids[None], output_hidden_states=True)
        features = select_features(outputs.hidden_states, draft.target_layer_ids)
        target_logits = outputs.logits[0]  # [T, V]
        head = target.get_output_embeddings()
        numerator, denominator = torch.tensor(0.0), torch.tensor(0.0)
        for anchor in anchors.tolist():
            rows = BLOCK - 1
            block = torch.full((rows,), MASK)
            block[0] = input_ids[anchor]
            hidden = draft(target.get_input_embeddings()(block)[None], features[:, :anchor],
                           torch.arange(anchor, anchor + rows)[None], torch.arange(anchor)[None])[0]  # [P, H]
            label_positions = torch.arange(anchor + 1, anchor + BLOCK)
            valid = (label_positions < length) & loss_mask[label_positions.clamp(max=length - 1)].bool()
            eval_mask = valid.long().cumprod(0).float()
            labels = input_ids[label_positions.clamp(max=length - 1)]
            previous = torch.cat((input_ids[anchor:anchor + 1], labels[:-1]))
            logits = head(hidden) + deepspec_markov_bias(draft, previous, hidden)  # [P, V]
            p = target_logits[label_positions.clamp(max=length - 1) - 1].softmax(-1)
            l1 = (logits.softmax(-1) - p).abs().sum(-1)
            accept = (1 - 0.5 * l1).clamp(0, 1)
            features_c = hidden if kind is None else torch.cat((hidden, draft.markov_head.markov_w1.weight[previous]),
                                                               -1)
            confidence = features_c @ draft.confidence_head.proj.weight[0] + draft.confidence_head.proj.bias
            terms = (0.1 * F.cross_entropy(logits, labels, reduction="none") + 0.9 * l1
                     + F.binary_cross_entropy_with_logits(confidence, accept, reduction="none"))
            position_weight = eval_mask * torch.exp(-torch.arange(rows) / gamma)
            numerator += (terms * position_weight).sum()
            denominator += position_weight.sum()
    torch.testing.assert_close(result.loss.detach(), numerator / denominator, rtol=1e-5, atol=1e-6)


def test_a_few_steps_lower_the_dspark_loss_and_the_draft_decodes_exactly(tmp_path):
    target = make_target("llama", seed=1)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MASK, (1, 6), generator=generator) for _ in range(4)]
    sequences = [plain_greedy(target, p, max_new_tokens=30)[0] for p in prompts]
    loss_mask = torch.cat((torch.zeros(6), torch.ones(30)))
    draft = dspark_draft("gated", seed=1).train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    anchors, losses = torch.Generator().manual_seed(2), []
    for step in range(40):
        sequence = sequences[step % len(sequences)]
        signals = target_signals(target, sequence, draft.target_layer_ids, 16, teacher_rows(loss_mask))
        result = dflash_loss(draft, target, sequence, loss_mask, 12, anchors, signals,
                             loss_weights=LossWeights(l1=0.9))
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(float(result.loss.detach()))
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4]), losses
    assert draft.markov_head.markov_w2.weight.grad.abs().sum() > 0  # the heads learn too
    assert draft.confidence_head.proj.weight.grad.abs().sum() > 0

    draft.eval().save_pretrained(tmp_path / "draft")
    for loaded in (DFlashDraftModel.from_pretrained(tmp_path / "draft"),
                   AutoModel.from_pretrained(tmp_path / "draft", trust_remote_code=True)):
        assert loaded.shifted_labels and loaded.config.markov_head_type == "gated"
        for prompt in prompts[:2]:
            output = loaded.spec_generate(target=target, input_ids=prompt, max_new_tokens=24)
            assert torch.equal(output, plain_greedy(target, prompt, max_new_tokens=24))


def test_train_markov_flags_build_save_and_continue_a_dspark_draft(tmp_path):
    prompts = save_tiny_target_and_prompts(tmp_path, 4)
    common = ["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--num-prompts", "3",
              "--gen-batch-size", "3", "--gen-max-new-tokens", "10", "--num-anchors", "4", "--epochs", "1",
              "--eval-prompts", str(prompts), "--num-eval", "1", "--eval-max-new-tokens", "8", "--l1-weight", "0.9"]
    main(["train", "--output", str(tmp_path / "dflash"), "--draft-block-size", "4", "--draft-layers", "1",
          "--mask-token", "w127", *common])
    main(["train", "--output", str(tmp_path / "dspark"), "--draft-block-size", "4", "--draft-layers", "1",
          "--mask-token", "w127", "--markov-rank", "6", "--markov-head", "rnn", "--confidence-head",
          "--token-cross-entropy", *common])
    config = json.loads((tmp_path / "dspark" / "draft" / "config.json").read_text())
    assert (config["shifted_labels"], config["markov_rank"], config["markov_head_type"],
            config["enable_confidence_head"], config["confidence_head_with_markov"]) == (True, 6, "rnn", True, True)
    assert json.loads((tmp_path / "dspark" / "evaluation.json").read_text())["lossless"] is True
    log = json.loads((tmp_path / "dspark" / "training_log.json").read_text())
    assert log["settings"]["token_cross_entropy"] is True

    # --init-from a DFlash draft: its layers carry over, the heads are new
    main(["train", "--output", str(tmp_path / "grown"), "--init-from", str(tmp_path / "dflash" / "draft"),
          "--markov-rank", "4", "--max-steps", "0", *common])
    grown = AutoModel.from_pretrained(tmp_path / "grown" / "draft", trust_remote_code=True)
    dflash = DFlashDraftModel.from_pretrained(tmp_path / "dflash" / "draft")
    assert grown.shifted_labels and grown.markov_head.kind == "vanilla" and grown.confidence_head is None
    for name, tensor in dflash.state_dict().items():
        torch.testing.assert_close(grown.state_dict()[name], tensor, rtol=0, atol=0)
    assert json.loads((tmp_path / "grown" / "evaluation.json").read_text())["lossless"] is True

    # --init-from a DSpark draft keeps its heads, and refuses flags that would change them
    with pytest.raises(SystemExit, match=r"--markov-rank 8 \(the draft's Markov head has rank 6\)"):
        main(["train", "--output", str(tmp_path / "again"), "--init-from", str(tmp_path / "dspark" / "draft"),
              "--markov-rank", "8", *common])
    with pytest.raises(SystemExit, match=r"--markov-head gated \(the draft's is rnn\)"):
        main(["train", "--output", str(tmp_path / "again"), "--init-from", str(tmp_path / "dspark" / "draft"),
              "--markov-rank", "6", "--markov-head", "gated", *common])


@pytest.mark.parametrize("flags, refusal", [
    (["--markov-head", "gated"], "--markov-head gated needs --markov-rank"),
    (["--markov-rank", "0", "--markov-head", "rnn"], "--markov-head rnn needs --markov-rank"),
    (["--markov-rank", "-2"], "--markov-rank -2: expected"),
    (["--markov-rank", "4", "--draft-vocab-size", "40"], "--draft-vocab-size"),
    (["--confidence-head", "--no-distill"], "--confidence-head .* drop --no-distill"),
    (["--token-cross-entropy", "--no-distill"], "--token-cross-entropy"),
])
def test_bad_dspark_flag_combinations_are_refused_by_name(tmp_path, flags, refusal):
    prompts = save_tiny_target_and_prompts(tmp_path, 2)
    with pytest.raises(SystemExit, match=refusal):
        main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts",
              str(prompts), "--mask-token", "w127", *flags])
    assert not (tmp_path / "run" / "responses.jsonl").exists()  # refused before anything was generated
