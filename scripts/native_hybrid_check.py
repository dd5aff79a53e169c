"""Is Transformers' OWN speculative decoding exact on hybrid (Gated DeltaNet) targets?

Measures, on tiny random float32 targets from tests/helpers.py (`make_hybrid_target`), whether
`target.generate(ids, assistant_model=..., do_sample=False)` (assisted decoding, and the native DFlash path
`speculation_type="dflash"` with a tiny random `MuseGlimmerAssistantModel` draft) returns the same tokens as plain
greedy `target.generate(ids, do_sample=False)`. No weights are downloaded.

Background: assisted decoding calls `cache.activate_past_recording(recurrent_states_to_keep=N)` (N = drafted tokens per
round) and then `cache.crop(-k)` after each verify forward of L tokens. `LinearAttentionCacheLayerMixin.crop` restores
`recurrent_states_history[-k]`, where the history is [state before the forward] + [states after tokens L-N+1 .. L-1].
So for L > N and k == N it restores the state from BEFORE the forward instead of after its first L-N tokens. Assisted
decoding verifies L = N+1 tokens (L = prompt+N in the first round), so a round that rejects all N drafts hits this;
native DFlash verifies L = block_size = N tokens and rejects at most N-1, so it does not.

Note: in 5.25 the assistant's `num_assistant_tokens`, `num_assistant_tokens_schedule` and
`assistant_confidence_threshold` are read from `assistant_model.generation_config`, not from `generate` kwargs, so
they are set there.

Columns: case, family, identical (k of n prompts), first differing generated-token index per prompt ('-' = identical),
k>=N rounds (verify rounds whose crop removes >= N tokens, over all prompts) / rounds.

Run (about a minute on 2 CPU cores):
    . .venv/bin/activate && python scripts/native_hybrid_check.py
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import time
from pathlib import Path

import torch
import transformers
import transformers.generation.candidate_generator as cg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import VOCAB_SIZE, make_hybrid_target  # noqa: E402

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # tiny models: more threads only contend on a shared CPU

FAMILIES = ("qwen3_5", "qwen3_next")
PROMPTS = [(5, 11), (9, 12), (16, 13)]  # (length, seed)
MAX_NEW = 24
ROUNDS: list[tuple[int, int, int]] = []  # (drafted c, accepted, N kept by the cache) per verify round


@contextlib.contextmanager
def instrumented(gen_class, oracle=None):
    """Log every verify round of `gen_class`; optionally overwrite its drafts with an oracle (see `oracle_drafts`)."""
    orig_get, orig_upd = gen_class.get_candidates, gen_class.update_candidate_strategy

    def get_candidates(self, input_ids, *args, **kwargs):
        if not hasattr(self, "_n_kept"):
            self._n_kept = self.num_drafting_tokens  # what `_assisted_decoding` passed to activate_past_recording
        ids, logits = orig_get(self, input_ids, *args, **kwargs)
        if oracle is not None:
            ids = oracle(input_ids, ids)
        return ids, logits

    def update(self, input_ids, scores, num_matches, *args, **kwargs):
        ROUNDS.append((scores.shape[1] - 1, int(num_matches), self._n_kept))
        return orig_upd(self, input_ids, scores, num_matches, *args, **kwargs)

    gen_class.get_candidates, gen_class.update_candidate_strategy = get_candidates, update
    try:
        yield
    finally:
        gen_class.get_candidates, gen_class.update_candidate_strategy = orig_get, orig_upd


def oracle_drafts(reference, mode, rng):
    """Replace the drafted tokens by the reference continuation: all of them right ('all'), none ('none'), a random
    number right ('mixed'), or a random number but never none when the block is full ('mixed_no_full_reject')."""

    def oracle(input_ids, ids):
        cur, c = input_ids.shape[1], ids.shape[1] - input_ids.shape[1]
        if c == 0:
            return ids
        right = {"all": c, "none": 0, "mixed": rng.randint(0, c), "mixed_no_full_reject": rng.randint(1, c)}[mode]
        ids = ids.clone()
        for j in range(c):
            pos = cur + j
            if pos >= reference.shape[1]:
                break
            tok = int(reference[0, pos])
            ids[0, pos] = tok if j < right else (tok + 1) % VOCAB_SIZE
        return ids

    return oracle


def set_assistant(model, n, schedule="constant", threshold=0.0):
    model.generation_config.num_assistant_tokens = n
    model.generation_config.num_assistant_tokens_schedule = schedule
    model.generation_config.assistant_confidence_threshold = threshold
    return model


def tiny_dflash_draft(block_size, seed=3):
    torch.manual_seed(seed)
    cfg = transformers.MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, block_size=block_size, mask_token_id=VOCAB_SIZE - 1, target_layer_ids=[0, 2],
        bos_token_id=None, eos_token_id=None, pad_token_id=None, max_position_embeddings=256, sliding_window=64)
    return transformers.MuseGlimmerAssistantModel(cfg).eval()


REFERENCES: dict = {}


def reference(family, target, length, seed):
    """Prompt and plain greedy output (cached per family)."""
    if (family, length, seed) not in REFERENCES:
        torch.manual_seed(seed)
        ids = torch.randint(1, VOCAB_SIZE - 1, (1, length))
        REFERENCES[family, length, seed] = ids, target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
    return REFERENCES[family, length, seed]


def run_case(name, family, target, gen_kwargs, gen_class, mode=None):
    firsts, same, rounds_before = [], 0, len(ROUNDS)
    for length, seed in PROMPTS:
        ids, ref = reference(family, target, length, seed)
        oracle = oracle_drafts(ref, mode, random.Random(seed)) if mode else None
        try:
            with instrumented(gen_class, oracle):
                out = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, **gen_kwargs)
        except Exception as exc:  # report, do not hide
            firsts.append(f"{type(exc).__name__}: {str(exc)[:60]}")
            continue
        diff = (out[0, length:] != ref[0, length:]).nonzero()
        if out.shape == ref.shape and len(diff) == 0:
            same += 1
            firsts.append("-")
        else:
            firsts.append(str(int(diff[0])) if len(diff) else f"len {out.shape[1] - length}")
    rounds = ROUNDS[rounds_before:]
    bad = sum(1 for c, m, n in rounds if c - m >= n)
    print(f"{name:<44} {family:<11} {same}/{len(PROMPTS):<9} {','.join(firsts):<14} {bad}/{len(rounds)}", flush=True)


def main():
    start = time.time()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, max_new_tokens={MAX_NEW}, "
          f"prompts (len, seed)={PROMPTS}")
    print(f"{'case':<44} {'family':<11} {'identical':<11} {'first diff':<14} k>=N rounds")
    A = cg.AssistedCandidateGenerator
    D = cg.DFlashTokenCandidateGenerator
    for family in FAMILIES:
        target = make_hybrid_target(family, seed=0)
        other = make_hybrid_target(family, seed=1)  # random assistant: mostly rejects
        for n in (2, 5, 10):
            run_case(f"assisted random-seed1 n={n}", family, target,
                     dict(assistant_model=set_assistant(other, n)), A)
        twin = set_assistant(copy.deepcopy(target), 5)  # identical weights: accepts everything
        run_case("assisted identical-copy n=5 (accept all)", family, target, dict(assistant_model=twin), A)
        saved = target.generation_config.to_dict()
        run_case("assisted target-as-own-assistant n=5", family, target,
                 dict(assistant_model=set_assistant(target, 5)), A)
        target.generation_config = transformers.GenerationConfig.from_dict(saved)
        anti = copy.deepcopy(twin)
        anti.lm_head.weight.data.neg_()  # proposes the argmin: rejects everything
        run_case("assisted negated-lm_head n=5 (reject all)", family, target, dict(assistant_model=anti), A)
        for mode in ("mixed", "mixed_no_full_reject"):
            run_case(f"assisted oracle {mode} n=5", family, target, dict(assistant_model=twin), A, mode)
        run_case("assisted random, assistant defaults (20,.4)", family, target,
                 dict(assistant_model=set_assistant(other, 20, "constant", 0.4)), A)
        # left-padded batch of 2
        torch.manual_seed(0)
        batch = torch.randint(1, VOCAB_SIZE - 1, (2, 8))
        batch[0, :3] = 0
        mask = (batch != 0).long()
        mask[1] = 1
        try:
            target.generate(batch, attention_mask=mask, assistant_model=set_assistant(other, 5), do_sample=False,
                            max_new_tokens=MAX_NEW)
            print(f"{'assisted left-padded batch of 2':<44} {family:<11} ran (no error)")
        except Exception as exc:
            print(f"{'assisted left-padded batch of 2':<44} {family:<11} refused: {type(exc).__name__}: {exc}")
        for block in (4, 8):
            run_case(f"native dflash random draft block={block}", family, target,
                     dict(assistant_model=tiny_dflash_draft(block), speculation_type="dflash"), D)
        for mode in ("all", "none", "mixed"):
            run_case(f"native dflash oracle {mode} block=8", family, target,
                     dict(assistant_model=tiny_dflash_draft(8), speculation_type="dflash"), D, mode)
    print(f"done in {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
