"""What `generate`'s processors cost the loop: plain `generate` and `spec_generate` with the same arguments (none,
repetition_penalty=1.1, no_repeat_ngram_size=4), greedy, on SmolLM2-135M-Instruct with the shipped draft, 4 gsm8k
prompts, 128 new tokens, one thread (MEASUREMENTS.md, 2026-12-05).

    python scripts/processors_cost.py
"""

from __future__ import annotations

import json
import time

import torch

from dflash_hf import load_demo
from dflash_hf.prompts import default_data_dir
from dflash_hf.tokens_dflash import generation_tokens

DATA = default_data_dir() / "gsm8k_test.jsonl"
CASES = {"none": {}, "repetition_penalty=1.1": {"repetition_penalty": 1.1},
         "no_repeat_ngram_size=4": {"no_repeat_ngram_size": 4}}


def main() -> None:
    """Print, per case: both wall times, the speedup, tau, and whether every output equals generate's."""
    torch.set_num_threads(1)
    target, tokenizer, draft = load_demo()
    stops = generation_tokens(target, tokenizer).stop_token_ids
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines()[:4]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
               for question in questions]
    common = {"max_new_tokens": 128, "pad_token_id": stops[0]}
    for name, arguments in CASES.items():
        plain_seconds = spec_seconds = 0.0
        taus, equal = [], True
        for prompt in prompts:
            started = time.perf_counter()
            plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    eos_token_id=stops, **common, **arguments)
            plain_seconds += time.perf_counter() - started
            started = time.perf_counter()
            result = draft.spec_generate(target=target, input_ids=prompt, temperature=0.0, stop_token_ids=stops,
                                         return_stats=True, **common, **arguments)
            spec_seconds += time.perf_counter() - started
            equal &= torch.equal(result.output_ids, plain)
            taus.append(result.tau)
        print(f"{name}: generate {plain_seconds:.1f} s, spec_generate {spec_seconds:.1f} s, "
              f"speedup {plain_seconds / spec_seconds:.2f}x, tau {sum(taus) / len(taus):.2f}, equal {equal}")


if __name__ == "__main__":
    main()
