"""Is `spec_generate` greedy output identical to the same target's own greedy `generate`, per precision?

SmolLM2-135M-Instruct (`load_demo`) with the shipped draft, on the CPU: float32, float16 and bfloat16 (draft in the
same dtype), torchao int8 / int4 weight-only and bitsandbytes 8-bit / nf4 (through Transformers' quantization
configs on the float32 checkpoint; float32 draft). For each: 4 gsm8k test prompts (chat template) x 96 new tokens,
greedy; how many outputs equal `target.generate`'s, where each difference starts and whether it is a near-tie
(`evaluation.compare_outputs`: the target's own logits hold both tokens within 16 ulps of the run's dtype), and tau
over all steps. A quantizer that is not installed or cannot run prints "not installed: <reason>".

    OMP_NUM_THREADS=1 python scripts/precision_check.py [--prompts 4] [--max-new-tokens 96] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Callable

import torch

from dflash_hf.demo import load_demo
from dflash_hf.evaluation import compare_outputs
from dflash_hf.prompts import default_data_dir, read_conversations, user_prompt_ids
from dflash_hf.sampling_dflash import cut_after_stop, mean_acceptance_length
from dflash_hf.settings_dflash import neutral_overrides
from dflash_hf.tokens_dflash import generation_tokens


class NotAvailable(Exception):
    """A quantizer that is not installed or cannot run here."""


def quantized_target(make_config: Callable[[], object], **load_kwargs):
    """SmolLM2 loaded from the converted float32 checkpoint with a Transformers quantization config."""
    from transformers import AutoModelForCausalLM

    from dflash_hf.smollm2 import DEFAULT_CACHE

    try:
        config = make_config()
    except ImportError as error:
        raise NotAvailable(f"{type(error).__name__}: {error}") from None
    try:
        return AutoModelForCausalLM.from_pretrained(DEFAULT_CACHE, dtype=torch.float32, quantization_config=config,
                                                    **load_kwargs).eval()
    except (ImportError, RuntimeError, ValueError, NotImplementedError, AssertionError) as error:
        raise NotAvailable(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}") from None


def torchao_config(kind: str):
    from transformers import TorchAoConfig

    try:
        from torchao.quantization import Int8WeightOnlyConfig
    except ImportError as error:
        raise ImportError(f"torchao ({error})") from None
    if kind == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    # torchao's Int4WeightOnlyConfig has no CPU format (plain: needs mslk; tile_packed_to_4d: CUDA, bfloat16);
    # the CPU one is the prototype Int4OpaqueTensor (aten._weight_int4pack_mm_for_cpu)
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=64))


def bnb_config(kind: str):
    from transformers import BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError(f"bitsandbytes ({error})") from None
    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)  # llm_int8_threshold 6.0 (the default)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def loader(name: str):
    """(target, draft) for a precision."""
    if name in ("float32", "float16", "bfloat16"):
        target, _, draft = load_demo(getattr(torch, name))
        return target, draft
    _, _, draft = load_demo(torch.float32)
    if name.startswith("torchao"):
        target = quantized_target(lambda: torchao_config(name.split()[1]))
    else:
        target = quantized_target(lambda: bnb_config(name.split()[1]), device_map="cpu")
    return target, draft


PRECISIONS = ["float32", "float16", "bfloat16", "torchao int8", "torchao int4", "bnb 8bit", "bnb nf4"]


@torch.no_grad()
def check(name: str, prompts: list[list[int]], tokenizer, max_new_tokens: int) -> list[str]:
    try:
        target, draft = loader(name)
    except NotAvailable as error:
        return [name, f"not installed: {error}", "", ""]
    tokens = generation_tokens(target, tokenizer, draft)
    stops = frozenset(tokens.stop_token_ids)
    neutral = neutral_overrides(target.generation_config)
    identical, notes, lengths = 0, [], []
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        input_ids = torch.tensor([prompt])
        plain = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=tokens.stop_token_ids,
                                pad_token_id=tokens.pad_token_id, **neutral)
        reference = cut_after_stop(plain[0, len(prompt):].tolist(), stops)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens,
                                         stop_token_ids=tokens.stop_token_ids, mask_token_id=tokens.mask_token_id,
                                         return_stats=True, **neutral)
        candidate = result.new_tokens(0)
        lengths += result.acceptance_lengths[0]
        if candidate == reference:
            identical += 1
            continue
        run_dtype = target.get_input_embeddings().weight.dtype
        verdict = compare_outputs(target, prompt, reference, candidate, dtype=run_dtype)
        gap = "" if verdict.logit_gap is None else f", gap {verdict.logit_gap:.3g} / tol {verdict.tolerance:.3g}"
        notes.append(f"p{index} @{verdict.first_divergence}: {verdict.verdict}{gap}")
    seconds = time.perf_counter() - started
    return [name, f"{identical}/{len(prompts)}", "; ".join(notes) or "-",
            f"{mean_acceptance_length(lengths):.2f} ({seconds:.0f} s)"]


def quiet() -> None:
    """No progress bars, no per-call warnings (bitsandbytes logs its float16 cast on every 8-bit product)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("torchao").setLevel(logging.ERROR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--only", nargs="*", default=None, help=f"a subset of {PRECISIONS}")
    args = parser.parse_args()
    quiet()
    _, tokenizer, _ = load_demo(torch.float32)  # also converts the checkpoint once, for the quantized loads
    questions = read_conversations(default_data_dir() / "gsm8k_test.jsonl", limit=args.prompts)
    prompts = [user_prompt_ids(tokenizer, turns[0]) for turns in questions]
    header = ["precision", "identical", "first differences / verdicts", "tau (time)"]
    print(" | ".join(header), flush=True)
    print(" | ".join("---" for _ in header), flush=True)
    for name in args.only or PRECISIONS:
        print(" | ".join(check(name, prompts, tokenizer, args.max_new_tokens)), flush=True)


if __name__ == "__main__":
    main()
