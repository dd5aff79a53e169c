"""`--gen-engine vllm`: the target's responses through vLLM's offline engine (`LLM.generate`), where the user installed
vLLM. It is never a dependency of the package: where `import vllm` fails the engine is refused by name
(`vllm_refusal`) before any model loads.

Data-parallel: under `accelerate launch` / `torchrun` every process runs an engine of its own on its own GPUs
(`engine_gpus`: `--gen-tensor-parallel-size` of them each, 1 by default) and answers its own share of the prompts into
its own shard file, as the other engines do (`data.generate_responses`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..loading import SMOLLM2
from ..settings_dflash import non_neutral_settings
from ..tokens_dflash import GenerationTokens


def vllm_refusal(target: str, generate_only: bool) -> str | None:
    """Why `--gen-engine vllm` cannot run this `train` (None: it can): vLLM not importable here, training in the same
    process (vLLM keeps the GPU memory it took), or the converted `smollm2` (vLLM loads a Hub id or a folder
    itself). Any number of processes may run it: each runs its own engine (`engine_gpus`)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return ("--gen-engine vllm: vLLM is not installed here (import vllm fails). Install it on a CUDA machine "
                "(pip install vllm; it is no dependency of dflash-hf), or pick --gen-engine generate or continuous")
    if not generate_only:
        return ("--gen-engine vllm needs --generate-only (vLLM keeps the GPU memory it took until exit): run "
                "`dflash-hf train --generate-only --gen-engine vllm --output OUTPUT ...` (on one process or under "
                "accelerate launch / torchrun, an engine per process), then train on its rows: `dflash-hf train "
                "--output OUTPUT ...` (the same prompts and output: nothing is generated again) or `--responses "
                "OUTPUT/responses.jsonl` (docs/training.md, 'Regeneration engines')")
    if target == SMOLLM2:
        return (f"--gen-engine vllm loads the target itself from a Hub id or a folder, not the converted --target "
                f"{SMOLLM2}: pass its Hub id or folder (e.g. --target HuggingFaceTB/SmolLM2-135M-Instruct)")
    return None


def engine_gpus(local_index: int, tensor_parallel_size: int, visible: str | None, device_count: int) -> list[str]:
    """The GPUs (as CUDA_VISIBLE_DEVICES names them) of the engine of the process `local_index` of this machine:
    the `tensor_parallel_size` GPUs from local_index x tensor_parallel_size on, of those `visible` (the
    CUDA_VISIBLE_DEVICES the launch set; None: all `device_count`). A launch that asks for more GPUs than the machine
    shows is refused, naming both counts."""
    names = [name for name in visible.split(",") if name.strip()] if visible is not None else [
        str(index) for index in range(device_count)]
    first, last = local_index * tensor_parallel_size, (local_index + 1) * tensor_parallel_size
    if last > len(names):
        raise ValueError(f"--gen-engine vllm: process {local_index} of this machine needs GPUs {first}..{last - 1} "
                         f"(--gen-tensor-parallel-size {tensor_parallel_size} each), but {len(names)} are visible; "
                         "launch at most GPUs / --gen-tensor-parallel-size processes per machine")
    return names[first:last]


# What torchrun / accelerate launch set for the launching process group: an engine of its own must not read them
# (vLLM's own data-parallel example clears them for each engine)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def engine_environment(gpus: list[str] | None) -> Iterator[None]:
    """While an engine starts: its own GPUs as CUDA_VISIBLE_DEVICES (`gpus`; None: the environment as it is) and no
    launch variables, so that the engine process vLLM spawns sees one machine of its own; restored after. This
    process has set up CUDA already, so the variables reach only that engine process: vLLM's default
    (VLLM_ENABLE_V1_MULTIPROCESSING=1), which a pinned engine needs (refused otherwise)."""
    if gpus is None:
        yield
        return
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        raise ValueError("--gen-engine vllm on several processes runs each engine in a process of its own on its "
                         "own GPUs; unset VLLM_ENABLE_V1_MULTIPROCESSING=0")
    saved = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", *LAUNCH_VARIABLES)}
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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


def load_vllm_target(name: str, dtype: torch.dtype, seed: int, tensor_parallel_size: int = 1,
                     gpus: list[str] | None = None) -> tuple[VllmTarget, Any]:
    """vLLM's `LLM` of the target `name` (a Hub id or a folder) in `dtype`, seeded, split over
    `tensor_parallel_size` GPUs (`--gen-tensor-parallel-size`), started on `gpus` (`engine_gpus`; None: where vLLM
    puts it), and the target's tokenizer."""
    from vllm import LLM

    try:
        generation_config = GenerationConfig.from_pretrained(name)
    except OSError:  # no generation_config.json: the one Transformers derives from the model's config
        generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(name))
    check_generation_config(name, generation_config)
    with engine_environment(gpus):
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
