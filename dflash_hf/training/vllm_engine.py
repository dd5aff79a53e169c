"""`--gen-engine vllm`: the target's responses through vLLM's offline engine (`LLM.generate`), where the user installed
vLLM. It is never a dependency of the package: where `import vllm` fails the engine is refused by name
(`vllm_refusal`) before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..loading import SMOLLM2
from ..settings_dflash import non_neutral_settings
from ..tokens_dflash import GenerationTokens


def vllm_refusal(target: str, num_processes: int, generate_only: bool) -> str | None:
    """Why `--gen-engine vllm` cannot run this `train` (None: it can): vLLM not importable here, several processes
    (vLLM runs its own tensor / data parallelism in one), training in the same process (vLLM keeps the GPU memory it
    took), or the converted `smollm2` (vLLM loads a Hub id or a folder itself)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return ("--gen-engine vllm: vLLM is not installed here (import vllm fails). Install it on a CUDA machine "
                "(pip install vllm; it is no dependency of dflash-hf), or pick --gen-engine generate or continuous")
    two_steps = ("run `dflash-hf train --generate-only --gen-engine vllm --output OUTPUT ...` as one process (no "
                 "accelerate launch / torchrun), then train on its rows: `dflash-hf train --output OUTPUT ...` "
                 "(the same prompts and output: nothing is generated again) or `--responses OUTPUT/responses.jsonl` "
                 "(docs/training.md, 'Regeneration engines')")
    if num_processes > 1:
        return (f"--gen-engine vllm on {num_processes} processes: vLLM runs its own tensor and data parallelism "
                f"inside one process; {two_steps}")
    if not generate_only:
        return f"--gen-engine vllm needs --generate-only (vLLM keeps the GPU memory it took until exit): {two_steps}"
    if target == SMOLLM2:
        return (f"--gen-engine vllm loads the target itself from a Hub id or a folder, not the converted --target "
                f"{SMOLLM2}: pass its Hub id or folder (e.g. --target HuggingFaceTB/SmolLM2-135M-Instruct)")
    return None


@dataclass(frozen=True)
class VllmTarget:
    """The target as vLLM runs it: its `LLM`, and the target's generation config (its stop and pad ids for
    `tokens_dflash.generation_tokens`, its top-k / top-p when sampling)."""

    llm: Any
    generation_config: GenerationConfig


# The target's generation-config processors `generate` applies that vLLM is not given here: a target whose config
# sets one (away from its neutral value, settings_dflash.NEUTRAL_GENERATION_SETTINGS) is refused, since vLLM's rows
# would not be the target's own. `repetition_penalty` is given to vLLM (the same rule: prompt and answer tokens);
# temperature, top-k, top-p too.
NOT_GIVEN_TO_VLLM = ("no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens", "suppress_tokens",
                     "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "sequence_bias",
                     "encoder_repetition_penalty", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def check_generation_config(name: str, config: GenerationConfig) -> None:
    """Refuse a target whose generation config sets a processor `generate` would apply and vLLM is not given."""
    set_here = [field for field in non_neutral_settings(config.to_dict()) if field in NOT_GIVEN_TO_VLLM]
    if set_here:
        raise ValueError(f"--gen-engine vllm: {name}'s generation config sets {', '.join(set_here)}, which "
                         "generate applies and this engine does not give vLLM, so the rows would not be the "
                         "target's own: use --gen-engine generate or continuous")


def load_vllm_target(name: str, dtype: torch.dtype, seed: int, tensor_parallel_size: int = 1
                     ) -> tuple[VllmTarget, Any]:
    """vLLM's `LLM` of the target `name` (a Hub id or a folder) in `dtype`, seeded, split over
    `tensor_parallel_size` GPUs (`--gen-tensor-parallel-size`), and the target's tokenizer."""
    from vllm import LLM

    try:
        generation_config = GenerationConfig.from_pretrained(name)
    except OSError:  # no generation_config.json: the one Transformers derives from the model's config
        generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(name))
    check_generation_config(name, generation_config)
    llm = LLM(model=name, dtype=str(dtype).removeprefix("torch."), seed=seed,
              tensor_parallel_size=tensor_parallel_size)
    return VllmTarget(llm, generation_config), AutoTokenizer.from_pretrained(name)


def vllm_responses(target: VllmTarget, prompts: list[tuple[int, list[int]]], tokens: GenerationTokens,
                   caps: list[int], temperature: float, seed: int) -> list[list[int]]:
    """The new tokens of each (index, prompt ids), in prompt order, through one `LLM.generate` call that schedules
    them all (continuous batching): each prompt with its own cap of new tokens and stop ids; sampled (temperature >
    0) with the target's top-k / top-p where its generation config sets them and the seed `seed` + the prompt's
    index, so a prompt's answer does not depend on its batch; the config's `repetition_penalty` in either case."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    config = target.generation_config
    processors = {name: value for name, value in (("top_k", config.top_k), ("top_p", config.top_p))
                  if value is not None} if temperature > 0 else {}
    if config.repetition_penalty not in (None, 1.0):
        processors["repetition_penalty"] = config.repetition_penalty
    settings = [SamplingParams(temperature=temperature, max_tokens=cap, stop_token_ids=list(tokens.stop_token_ids),
                               seed=seed + index if temperature > 0 else None, **processors)
                for (index, _), cap in zip(prompts, caps)]
    outputs = target.llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts], settings,
                                  use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]  # LLM.generate keeps the prompts' order
