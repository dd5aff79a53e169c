"""The draft seam and finished rows: the proposer drafts through a draft backend (eager or compiled) and never asks
which; finished rows leave every stage on both target backends, so processors, stopping criteria and the draft see
live rows only, and no sentinel (an accepted count of -1, a bool from `drop_rows`) marks them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from helpers import VOCAB_SIZE, left_pad_prompts, make_draft, make_target, plain_greedy, prompts_of
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import dflash_hf.generation_dflash as generation_dflash
from dflash_hf import backends_dflash, static_dflash, steps_dflash
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.versions_dflash import torch_refusal

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_hf"
DYNAMO_ONLY = {"backend": "eager"}  # dynamo's capture and guards without inductor's build (as tests/test_compiled.py)
COMPILES = pytest.mark.skipif(torch_refusal("compile=True") is not None,
                              reason=f"compile=True is refused on torch {torch.__version__}")


# --- The shape of the seams ------------------------------------------------------------------------------------------


def identifiers(path: Path) -> set[str]:
    """Every name a module's code uses: names, attributes, arguments, definitions and imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name)
    return found


def test_the_proposer_never_asks_whether_the_draft_is_compiled():
    """No name of the proposer module speaks of compiling or of a static cache, and it builds no context cache: the
    draft backend (draft_backends_dflash) owns the cache kind, the forward and its rows."""
    names = identifiers(PACKAGE / "proposer_dflash.py")
    leaked = sorted(name for name in names if "compile" in name.lower() or "static" in name.lower())
    assert not leaked, leaked
    assert not names & {"CacheColumns", "compaction", "reorder_columns", "slots"}


def returns_none(function) -> bool:
    return inspect.signature(function).return_annotation in (None, "None")


def test_drop_rows_returns_nothing_on_every_target_backend():
    """`drop_rows` is a command on every backend (the protocol and each implementation): no bool tells the loop
    whether the rows left."""
    backends = [cls for module in (backends_dflash, static_dflash) for cls in vars(module).values()
                if inspect.isclass(cls) and cls.__module__ == module.__name__ and hasattr(cls, "drop_rows")]
    assert {cls.__name__ for cls in backends} >= {"TargetBackend", "EagerBackend", "RecurrentRollback"}
    assert [cls.__name__ for cls in backends if not returns_none(cls.drop_rows)] == []


def function_tree(function) -> ast.AST:
    return ast.parse(inspect.getsource(function))


def test_no_accepted_count_is_a_sentinel():
    """`commit` gives no row a -1 and `keep_context` compares no count with 0: no stage knows a finished row."""
    minus_one = [node for node in ast.walk(function_tree(steps_dflash.commit)) if isinstance(node, ast.UnaryOp)
                 and isinstance(node.op, ast.USub) and getattr(node.operand, "value", None) == 1]
    assert not minus_one
    compared = [ast.unparse(node) for node in ast.walk(function_tree(steps_dflash.keep_context))
                if isinstance(node, ast.Compare)
                and any(getattr(side, "value", None) == 0 for side in (node.left, *node.comparators))]
    assert not compared


# --- Finished rows, seen by nobody -----------------------------------------------------------------------------------


def row_of(prompts: torch.Tensor, sequence: torch.Tensor) -> int:
    """The batch row whose prompt (as passed, padding included) opens `sequence` [L]."""
    width = prompts.shape[1]
    rows = [row for row in range(prompts.shape[0]) if torch.equal(sequence[:width], prompts[row])]
    assert len(rows) == 1
    return rows[0]


class Steps:
    """Counts the loop's steps (0: the prefill) by wrapping `plan_step`."""

    def __init__(self, monkeypatch) -> None:
        self.current = 0
        original = generation_dflash.plan_step

        def counted(*args, **kwargs):
            self.current += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(generation_dflash, "plan_step", counted)


class RecordingProcessor(LogitsProcessor):
    """A user's processor that changes nothing and records (step, row) of every call."""

    def __init__(self, prompts: torch.Tensor, steps: Steps) -> None:
        self.prompts, self.steps, self.calls = prompts, steps, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += [(self.steps.current, row_of(self.prompts, ids)) for ids in input_ids]
        return scores


class RecordingCriterion(StoppingCriteria):
    """A user's stopping criterion that never stops and records (step, row) of every call."""

    def __init__(self, prompts: torch.Tensor, steps: Steps) -> None:
        self.prompts, self.steps, self.calls = prompts, steps, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.calls += [(self.steps.current, row_of(self.prompts, ids)) for ids in input_ids]
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def decode_recording(monkeypatch, target, draft, input_ids, attention_mask, stop: int, new: int, **arguments):
    """`spec_generate` with a recording processor, stopping criterion, prefix_allowed_tokens_fn and draft: (result,
    {what: [(step, row)]}, drafted {(step, row): tokens})."""
    steps = Steps(monkeypatch)
    processor, criterion = RecordingProcessor(input_ids, steps), RecordingCriterion(input_ids, steps)
    allowed_calls, drafted, draft_calls = [], {}, []
    original_propose = DFlashProposer.propose

    def recording_propose(self, step):
        proposal = original_propose(self, step)
        tokens = getattr(proposal, "tokens", proposal)
        for row, row_tokens in zip(step.row_ids, tokens.tolist()):
            draft_calls.append((steps.current, row))
            drafted[steps.current, row] = row_tokens
        return proposal

    def allowed(batch_id: int, sequence: torch.Tensor) -> list[int]:
        allowed_calls.append((steps.current, batch_id))
        return list(range(VOCAB_SIZE))

    monkeypatch.setattr(DFlashProposer, "propose", recording_propose)
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=new, temperature=0.0, pad_token_id=0, eos_token_id=stop,
                                 logits_processor=LogitsProcessorList([processor]),
                                 stopping_criteria=StoppingCriteriaList([criterion]),
                                 prefix_allowed_tokens_fn=allowed, return_stats=True, **arguments)
    monkeypatch.undo()
    calls = {"processor": processor.calls, "criterion": criterion.calls, "prefix_allowed_tokens_fn": allowed_calls,
             "draft": draft_calls}
    return result, calls, drafted


@COMPILES
@pytest.mark.parametrize("tree_size", [None, 4])
def test_finished_rows_reach_no_processor_criterion_or_draft_eager_or_compiled(monkeypatch, tree_size):
    """A left-padded batch whose rows end at different steps (one hits the EOS early, the others run to
    max_new_tokens): on the eager and the compiled backend every output equals `generate`'s, and a user's logits
    processor, stopping criterion, `prefix_allowed_tokens_fn` and the draft are called at each step for the rows
    still decoding only (a row takes part in as many steps as its acceptance lengths count). The compiled draft,
    whose batch keeps finished rows, drafts for each live row what the eager draft drafts."""
    target, draft = make_target(seed=3), make_draft(3, block_size=6)
    prompts = prompts_of([5, 9, 3], seed=4)
    input_ids, attention_mask = left_pad_prompts(prompts)
    new = 14
    stop = plain_greedy(target, prompts[1], new)[0, prompts[1].shape[1] + 3].item()  # row 1 ends at its 4th token
    expected = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new, do_sample=False,
                               pad_token_id=0, eos_token_id=stop)
    drafted = {}
    for compile in (False, DYNAMO_ONLY):
        result, calls, drafted[bool(compile)] = decode_recording(
            monkeypatch, target, draft, input_ids, attention_mask, stop, new, tree_size=tree_size, compile=compile)
        assert torch.equal(result.output_ids, expected), compile
        assert min(result.num_new_tokens) < max(result.num_new_tokens)  # rows end apart
        steps_taken = [len(lengths) for lengths in result.acceptance_lengths]  # per row: the steps it was live in
        for what, recorded in calls.items():
            late = sorted({(step, row) for step, row in recorded if step > steps_taken[row]})
            assert not late, f"compile={compile}: {what} called for finished rows (step, row): {late}"
            assert {row for _, row in recorded} == {0, 1, 2}, what
    full_width = [key for key, tokens in drafted[False].items() if len(tokens) == draft.block_size - 1]
    assert len(full_width) > 5
    assert {key: drafted[True][key] for key in full_width} == {key: drafted[False][key] for key in full_width}


@COMPILES
def test_the_compiled_loop_commits_and_keeps_for_live_rows_only(monkeypatch):
    """Each step's commit returns one accepted count (>= 0) per live row, and the target backend's drop_rows returns
    nothing, on the compiled backend whose batch keeps the finished rows in its tensors."""
    target, draft = make_target(seed=5), make_draft(5, block_size=4)
    prompts = prompts_of([4, 7], seed=6)
    input_ids, attention_mask = left_pad_prompts(prompts)
    stop = plain_greedy(target, prompts[0], 12)[0, prompts[0].shape[1] + 2].item()
    counts, dropped = [], []
    original_commit = generation_dflash.commit

    def recording_commit(state, step, verdict, settings):
        accepted = original_commit(state, step, verdict, settings)
        counts.append((list(state.active), accepted))
        return accepted

    original_drop = generation_dflash.drop_finished

    def recording_drop(state, proposer):
        drop_rows = state.backend.drop_rows

        def recorded(keep, index):
            dropped.append(drop_rows(keep, index))

        state.backend.drop_rows = recorded
        try:
            return original_drop(state, proposer)
        finally:
            del state.backend.drop_rows

    monkeypatch.setattr(generation_dflash, "commit", recording_commit)
    monkeypatch.setattr(generation_dflash, "drop_finished", recording_drop)
    expected = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
                               pad_token_id=0, eos_token_id=stop)
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12,
                                 pad_token_id=0, eos_token_id=stop, compile=DYNAMO_ONLY)
    assert torch.equal(result, expected)
    assert dropped == [None]  # row 0 left once
    assert [len(active) for active, _ in counts][-1] == 1
    assert all(len(accepted) == len(active) and min(accepted) >= 0 for active, accepted in counts)
