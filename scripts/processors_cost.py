"""What `generate`'s processors cost the loop, and what the draft seeing them gives back: per case (none,
repetition_penalty 1.1 and 1.3, no_repeat_ngram_size=4, bad_words_ids), plain `generate` against `spec_generate` with
the same arguments, its draft shaped by the processors (draft_processors="built", the default) and not
(draft_processors="none"); greedy, SmolLM2-135M-Instruct with the shipped draft, one thread (MEASUREMENTS.md,
"generate's processors").

    python scripts/processors_cost.py --dataset gsm8k humaneval --num-prompts 4 --max-new-tokens 128 [--block-size 3]
        [--tree-size 8] [--draft FOLDER] [--cases none repetition_penalty=1.3]
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_hf import load_demo
from dflash_hf.prompts import default_data_dir, read_conversations, user_prompt_ids
from dflash_hf.tokens_dflash import generation_tokens

FILES = {"gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl", "mbpp": "mbpp_sanitized_test.jsonl"}
BAD_WORDS = ("**", " Let", " So")  # words the draft proposes often on these sets, so that banning them matters


def cases(tokenizer) -> dict[str, dict]:
    """The processor arguments measured, by name."""
    bad_words = [tokenizer.encode(word, add_special_tokens=False) for word in BAD_WORDS]
    return {"none": {}, "repetition_penalty=1.1": {"repetition_penalty": 1.1},
            "repetition_penalty=1.3": {"repetition_penalty": 1.3},
            "no_repeat_ngram_size=4": {"no_repeat_ngram_size": 4},
            f"bad_words_ids={list(BAD_WORDS)}": {"bad_words_ids": bad_words}}


def timed(function, **arguments) -> tuple[float, object]:
    """(seconds, result) of `function(**arguments)`."""
    started = time.perf_counter()
    result = function(**arguments)
    return time.perf_counter() - started, result


def main() -> None:
    """Print a markdown table: per dataset and case, generate's time, then per draft_processors choice the time,
    speedup and tau, and whether every output equals generate's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", nargs="+", default=["gsm8k", "humaneval"], choices=sorted(FILES))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None, help="default: the draft's trained size")
    parser.add_argument("--tree-size", type=int, default=None, help="drafted nodes of a tree (default: a chain)")
    parser.add_argument("--draft", default=None, help="a draft folder for SmolLM2 (default: the shipped draft)")
    parser.add_argument("--cases", nargs="+", default=None, help="the cases to run, by name (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer, draft = load_demo(draft_path=args.draft)
    stops = generation_tokens(target, tokenizer).stop_token_ids
    common = {"max_new_tokens": args.max_new_tokens, "pad_token_id": stops[0]}
    spec = {"block_size": args.block_size, "tree_size": args.tree_size}
    warm = torch.tensor([user_prompt_ids(tokenizer, "Hello")])  # first calls time the CPU kernels: not measured
    target.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, **common)
    draft.spec_generate(target=target, input_ids=warm, temperature=0.0, stop_token_ids=stops, **common, **spec)
    print("| set | arguments | generate s | draft sees them: s, speedup, tau | draft does not: s, speedup, tau "
          "| equal |\n|---|---|---:|---|---|---|")
    for dataset in args.dataset:
        turns = read_conversations(default_data_dir() / FILES[dataset], limit=args.num_prompts)
        prompts = [torch.tensor([user_prompt_ids(tokenizer, conversation[0])]) for conversation in turns]
        for name, arguments in cases(tokenizer).items():
            if args.cases is not None and name not in args.cases:
                continue
            plain_seconds, equal, cells = 0.0, True, []
            outputs = []
            for prompt in prompts:
                seconds, plain = timed(target.generate, inputs=prompt, attention_mask=torch.ones_like(prompt),
                                       do_sample=False, eos_token_id=stops, **common, **arguments)
                plain_seconds += seconds
                outputs.append(plain)
            for choice in ("built", "none"):
                spec_seconds, taus = 0.0, []
                for prompt, plain in zip(prompts, outputs):
                    seconds, result = timed(draft.spec_generate, target=target, input_ids=prompt,
                                            temperature=0.0, stop_token_ids=stops, return_stats=True,
                                            draft_processors=choice, **common, **spec, **arguments)
                    spec_seconds += seconds
                    equal &= torch.equal(result.output_ids, plain)
                    taus.append(result.tau)
                cells.append(f"{spec_seconds:.1f}, {plain_seconds / spec_seconds:.2f}x, {sum(taus) / len(taus):.2f}")
            print(f"| {dataset} | `{name}` | {plain_seconds:.1f} | {cells[0]} | {cells[1]} | "
                  f"{'yes' if equal else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
