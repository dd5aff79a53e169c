"""What differs between the Transformers and torch releases dflash-hf runs on (pyproject's ranges: Transformers
4.57.6 to 5.25.x, torch 2.6.0 to 2.15.0; README, "Which torch").

Every difference the package depends on is answered here, and no other module asks which Transformers or torch is
installed:

- torch: what needs a newer torch than pyproject's floor (`torch_refusal`: `compile=True`, FSDP training's sharded
  safetensors checkpoints), and whether SDPA's own
  grouped-query mode gives the numbers of Transformers' copied heads (`exact_grouped_query_sdpa`);
- the forward's cache keyword (`cache_keyword`, `returned_cache`): `past_key_values` on 4.57, `cache` on 5.x;
- recurrent states (`is_linear_attention_layer`): model-specific caches on 4.57, linear-attention cache layers on 5.x;
- a layer that cannot be cut back (`refuses_crop`): no flag on 4.57; 5.24's `is_croppable` is False once a recurrent
  state exists; 5.25's is a class attribute, True;
- a recurrent layer's token count (`align_token_count`): none before 5.25; 5.25's `cumulative_length_linear`, which
  `DynamicCache.get_seq_length()` reports when layer 0 is recurrent (so positions never come from it here);
- the native DFlash draft (`native_draft_classes`): `MuseGlimmerAssistantModel` from 5.24 on;
- Gemma-4's "proportional" rope (`rope_type_refusal`), which DeepSpec's Gemma-4 drafts use: from 5.5 on;
- functions a Hub kernel may replace in a recurrent mixer (`kernel_replacements`), and a Gated DeltaNet mixer's own
  function modules, whose calls a chain's rollback replays (`gated_delta_functions`): from 5.25 on;
- Transformers' own assisted decoding on recurrent targets (`assisted_decoding_runs_recurrent_targets`): refused
  (`_is_stateful`) before 5.25; from 5.25 on it runs them by recording past states and cropping them;
- Transformers' continuous batching (`continuous_batching_refusal`, `generate_batch_arguments`): 5.25 runs it on the
  CPU too, stops on a list of EOS ids and takes the paged cache's size (`paged_cache_plan`); 4.57 sizes its cache
  from GPU memory only and stops on one id;
- where a `StaticCache` writes (`static_write_arguments`, `rewind_static_cache`): at the forward's `cache_position`
  on 4.57; at the cache's own tensor counter on 5.x, which takes no `cache_position` and is cut back by `crop`.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import transformers

try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # Transformers 4.x: recurrent states live in model-specific caches
    LinearAttentionCacheLayerMixin = None

TRANSFORMERS_VERSION = transformers.__version__
TRANSFORMERS_RELEASE = tuple(int(part) for part in TRANSFORMERS_VERSION.split(".")[:2])  # (5, 25)
# `generate` leaves each row's left padding out of its repetition penalty in Transformers 5 (5.25 checked); 4.57.6
# counts the padding (both tested against generate: tests/test_generate_arguments.py)
REPETITION_PENALTY_SKIPS_PADDING = TRANSFORMERS_RELEASE >= (5, 0)
TORCH_VERSION = torch.__version__  # "2.15.0+cu130"
TORCH_RELEASE = tuple(int(part) for part in TORCH_VERSION.split("+")[0].split(".")[:2])  # (2, 15)

OLDEST_TORCH = (2, 6)  # pyproject's floor: Transformers 5.25 needs it (CI runs the oldest set on 2.6.0)
# Features that need a newer torch than the floor: (the oldest release they were checked on here, why not older, the
# way to run without them).
NEWER_TORCH_FEATURES = {
    "compile=True": ((2, 13), "on torch 2.6 dynamo breaks Llama's and Gemma's forwards into several graphs and "
                              "recompiles the verify after its first step", "leave compile=True off"),
    # checked in the sources of torch 2.8.0, 2.9.0, 2.13.0, 2.14.1 and run on 2.15.0
    "FSDP training": ((2, 9), "its sharded checkpoints are safetensors written and read by torch.distributed."
                              "checkpoint's HuggingFaceStorageWriter(save_distributed=True) and "
                              "HuggingFaceStorageReader, which 2.9 has as 2.15 does; 2.8's take other arguments "
                              "through fsspec, and older torches have none (their own format pickles its index)",
                      "train data-parallel without the FSDP config (accelerate launch without examples/"
                      "accelerate_fsdp.yaml: whole checkpoints)"),
}
GROUPED_QUERY_SDPA_EXACT_FROM = (2, 9)  # measured: 2.6 and 2.8 differ in the last bits; 2.9 on are bit-equal


def torch_refusal(feature: str) -> str | None:
    """Why the installed torch cannot run `feature` (a key of NEWER_TORCH_FEATURES), naming the release it needs, or
    None."""
    oldest, reason, without = NEWER_TORCH_FEATURES[feature]
    if TORCH_RELEASE >= oldest:
        return None
    return (f"{feature} needs torch >= {oldest[0]}.{oldest[1]} ({reason}); this is torch {TORCH_VERSION}. Upgrade "
            f"torch (README, \"Which torch\"), or {without}.")


def exact_grouped_query_sdpa() -> bool:
    """Whether this torch's SDPA over grouped key/value heads (`enable_gqa=True`, no copies) gives exactly the logits
    of Transformers' sdpa, which copies each key/value head per query head (`kernels_dflash.use_grouped_query_sdpa`
    switches only where it does)."""
    return TORCH_RELEASE >= GROUPED_QUERY_SDPA_EXACT_FROM


def cache_keyword(target: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` on Transformers 5.x, `past_key_values` on 4.x."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    forwards = (target.forward, decoder.forward)  # a subclass may take **kwargs; its decoder names the argument
    return "cache" if any("cache" in inspect.signature(forward).parameters
                          for forward in forwards) else "past_key_values"


def returned_cache(outputs: Any) -> Any:
    """The KV cache of a forward's outputs (`cache` on 5.x, `past_key_values` on 4.x)."""
    cache = getattr(outputs, "cache", None)
    return outputs.past_key_values if cache is None else cache


def is_linear_attention_layer(layer: Any) -> bool:
    """A cache layer of Transformers' linear-attention kind (convolution and recurrent states; keys too or not)."""
    return LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)


def refuses_crop(layer: Any) -> bool:
    """Whether Transformers says the cache layer cannot be cropped (5.24's `is_croppable` False; no flag on 4.57)."""
    return getattr(layer, "is_croppable", True) is False


def align_token_count(layer: Any, num_columns: int) -> None:
    """Set a recurrent cache layer's token count (5.25's `cumulative_length_linear`; nothing before) to the cache's
    columns, as if its forwards had run over them all (padding and rejected columns included, as the attention layers
    keep them). dflash-hf passes positions explicitly; this keeps `get_seq_length()` true for whoever else reads it."""
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor):
        count.fill_(num_columns)


def native_draft_classes() -> tuple[type, type]:
    """(MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel), or a ValueError saying this Transformers lacks them."""
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    except ImportError:
        raise ValueError(f"The installed Transformers {TRANSFORMERS_VERSION} has no native DFlash draft class "
                         "(MuseGlimmerAssistantModel, Transformers >= 5.24); upgrade Transformers to convert to it. "
                         "Native folders still load here with DFlashDraftModel.from_pretrained.") from None
    return MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel


# Transformers' first release with Gemma-4 (`models/gemma4`) and with it the "proportional" rope of its full-attention
# layers (half of each head's frequencies rotate, a quarter of them in Gemma-4's config, the rest stay zero).
GEMMA4_RELEASE = "5.5"


def rope_type_refusal(rope_type: str, what: str) -> str | None:
    """Why the installed Transformers cannot build `what`'s rope of type `rope_type` (not in its rope table), with the
    fix, or None."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "default" or rope_type in ROPE_INIT_FUNCTIONS:
        return None
    release = GEMMA4_RELEASE if rope_type == "proportional" else None
    return (f"{what} uses the {rope_type!r} rope, which the installed Transformers {TRANSFORMERS_VERSION} does not "
            "have; upgrade Transformers" + (f" to >= {release}, the release that brought Gemma-4 and its rope "
                                            f"(pip install -U \"transformers>={release}\")." if release else "."))


def kernel_replacements(mixer: torch.nn.Module) -> list[str]:
    """What a Hub kernel replaced in a recurrent mixer that is handed the cache: the mixer's own forward, or a function
    of its that takes the cache (5.25's `causal_conv1d_forward`). Such a kernel may keep state outside the cache layer,
    where no rollback can see it. Kernels for functions that take tensors only (the gated delta rule, the convolution
    itself) are fine: their state goes in and out as tensors of the cache. Empty before Transformers 5.25.

    5.25's `kernelize` (which `from_pretrained` runs by default, `use_kernels`) gives each mixer its own copy of every
    replaceable function (`_kernel_funcs`) and binds a kernel's forward onto that copy, or onto the mixer itself,
    marking it with `_kernel_repo`.
    """
    replaced = [f"{type(mixer).__name__}.forward"] if vars(mixer).get("_kernel_repo") is not None else []
    for name, function in (vars(mixer).get("_kernel_funcs") or {}).items():
        own = vars(function)
        if own.get("_kernel_repo") is None and "forward" not in own:
            continue  # Transformers' own function
        parameters = inspect.signature(type(function).forward).parameters
        if any(argument in parameters for argument in ("cache", "cache_params", "past_key_values")):
            replaced.append(name)
    return replaced


def assisted_decoding_runs_recurrent_targets() -> bool:
    """Whether Transformers' own assisted decoding (prompt lookup, its DFlash) runs targets with recurrent layers: from
    5.25 on, by recording past states and cropping them (not always exactly: docs/hybrid.md); not before."""
    return TRANSFORMERS_RELEASE >= (5, 25)


def gated_delta_functions(mixer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module] | None:
    """A Gated DeltaNet mixer's own (convolution, chunked, token-by-token gated delta rule) function modules (a verify
    calls the first two), or None where it has none (before 5.25, another family). From 5.25 on each mixer holds a
    private copy of every replaceable function (`use_kernelized_func`, `_kernel_funcs`) and calls it through
    `__call__`, so forward hooks on the copies see each call's arguments."""
    functions = vars(mixer).get("_kernel_funcs") or {}
    parts = tuple(functions.get(name) for name in ("causal_conv1d_forward", "chunk_gated_delta_rule",
                                                   "fused_recurrent_gated_delta_rule"))
    return parts if all(isinstance(part, torch.nn.Module) for part in parts) else None


def shared_gated_delta_functions(mixer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The module-level (convolution, chunked gated delta rule) function modules that a Gated DeltaNet mixer's forward
    calls, shared by every mixer of its class, or None (before 5.25, another family). Under torch.compile the
    `kernels` package's dispatch runs the plain function from these, not the mixer's private copy
    (`gated_delta_functions`), so only their hooks see a compiled forward's calls."""
    private = gated_delta_functions(mixer)
    if private is None:
        return None
    module = inspect.getmodule(type(mixer))
    shared = [[value for value in vars(module).values() if type(value) is type(function)] if module else []
              for function in private[:2]]
    return (shared[0][0], shared[1][0]) if all(len(found) == 1 for found in shared) else None


def static_write_arguments(target: torch.nn.Module, start: int, width: int, device: torch.device) -> dict[str, Any]:
    """What a forward over a `StaticCache` needs to write `width` columns from column `start`: `cache_position` on
    4.57 (the cache writes where it says); nothing on 5.x (the cache writes at its own counter, kept by
    `rewind_static_cache`)."""
    if "cache_position" not in inspect.signature(target.forward).parameters:
        return {}
    return {"cache_position": torch.arange(start, start + width, device=device)}


def rewind_static_cache(cache: Any, columns: int) -> None:
    """Cut a `StaticCache`'s write counter back by `columns` (5.x: `crop`; 4.57 has no counter: nothing to do).
    The tensors keep their addresses; the columns past the counter are overwritten by the next forward."""
    if columns <= 0:
        return
    for layer in cache.layers:  # attention layers only (a recurrent layer of a hybrid target has no columns)
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.crop(-columns)


CONTINUOUS_BATCHING_ON_CPU_FROM = (5, 25)  # checked: 4.57.6 fails on the CPU, 5.25 runs (releases between: unchecked)


def continuous_batching_refusal(device: torch.device) -> str | None:
    """Why Transformers' continuous batching (`generate_batch`) cannot run on `device` here, or None: 4.57 sizes its
    paged cache from GPU memory only (4.57.6 fails on the CPU); 5.25 runs on both."""
    if TRANSFORMERS_RELEASE >= CONTINUOUS_BATCHING_ON_CPU_FROM or device.type == "cuda":
        return None
    return (f"--gen-engine continuous on the {device.type}: Transformers {TRANSFORMERS_VERSION}'s continuous batching "
            "sizes its cache from GPU memory only (4.57.6 fails on the CPU); use --gen-engine generate here, or "
            "Transformers 5.25")


CONTINUOUS_BATCHING_PAGE = 256  # tokens of one paged-cache block (Transformers 5.25's default page size)
CONTINUOUS_BATCH_TOKENS = 8192  # tokens one continuous-batching forward takes at most (5.25's default; it splits
# longer prefills over several forwards)
CONTINUOUS_CACHE_MEMORY = 0.8  # the share of the device's free memory the paged cache and its forwards may take
# (5.25's own default where logit processors run; 0.9 without)
CONTINUOUS_LOGIT_ROWS = 1024  # rows of logits 5.25 reserves for at most (its max_requests_per_batch fallback)


@dataclass(frozen=True)
class PagedCachePlan:
    """How large Transformers' paged cache is made for one `generate_batch` call (`paged_cache_plan`)."""

    num_blocks: int  # blocks of `page_size` tokens of every layer's keys and values
    page_size: int
    max_batch_tokens: int  # tokens of one forward
    needed_blocks: int  # what the rows could ever hold at once: each its prompt and its whole cap, plus one
    footprint: int  # bytes: the cache, what grows with it and with the forward's tokens, the logits (a bound)
    budget: int  # bytes it may take: CONTINUOUS_CACHE_MEMORY of the free memory

    @property
    def tokens(self) -> int:
        """Tokens the cache holds at once, over all rows."""
        return self.num_blocks * self.page_size


def paged_cache_plan(config: Any, dtype: torch.dtype, row_tokens: list[int], free_bytes: int,
                     memory_fraction: float = CONTINUOUS_CACHE_MEMORY) -> PagedCachePlan:
    """The paged cache for rows of `row_tokens` tokens each (prompt and cap) of a model with this decoder `config`
    whose cache and activations are `dtype`, on a device with `free_bytes` free: the blocks the rows need, but no more
    than `memory_fraction` of the free memory holds, so a batch of many long rows gets the blocks that fit and
    continuous batching starts the rest as earlier answers finish and free their blocks.

    The footprint bounds Transformers 5.25's own (`PagedAttentionMemoryHandler`) from above: per cached token its
    keys and values in every layer, their copy at the attention peak as sdpa reads them (key/value heads repeated to
    the query heads), its read indices and a column of the sdpa mask per forward token; per forward token the larger of
    its logits (float32) and its attention peak, and its index tensors (doubled, as 5.25's asynchronous batching
    does); besides, the logits of CONTINUOUS_LOGIT_ROWS rows and two spare blocks. A row that alone does not fit is
    refused: no cache would hold it."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    item, page = dtype.itemsize, CONTINUOUS_BATCHING_PAGE
    batch_tokens = max(1, min(sum(row_tokens), CONTINUOUS_BATCH_TOKENS))
    logits_row = config.hidden_size * item + config.vocab_size * 4  # [hidden] in dtype, [vocab] float32
    cache_token = config.num_hidden_layers * 2 * kv_heads * head_dim * item  # keys and values of every layer
    read_token = (2 * heads + kv_heads) * head_dim * item + 2 * 8  # the sdpa read's copy, read indices (int64, x2)
    block = page * (cache_token + read_token + batch_tokens * item)  # a block and the mask columns it adds
    forward_token = max(logits_row, item * (config.hidden_size + heads * head_dim + 2 * kv_heads * head_dim
                                            + (2 * heads + kv_heads) * head_dim)) + 2 * (8 * 4 + 32 * 4 + 2 * 8)
    fixed = (CONTINUOUS_LOGIT_ROWS * logits_row + 2 * page * cache_token + batch_tokens * forward_token
             + batch_tokens * batch_tokens * item)  # logits, spare blocks, the forward's tensors, its own mask columns
    budget = int(free_bytes * memory_fraction)
    needed = sum(-(-tokens // page) for tokens in row_tokens) + 1
    blocks = min(needed, max(0, (budget - fixed) // block))
    if blocks * page < max(row_tokens, default=0):
        raise ValueError(
            f"--gen-engine continuous: {free_bytes / 2**30:.1f} GiB free on the device hold a paged cache of "
            f"{blocks * page} tokens, but one row needs {max(row_tokens)} (its prompt and its answer cap): free "
            "device memory, cap the answers (--gen-max-new-tokens, or a lower --max-length), or use --gen-engine "
            "generate")
    return PagedCachePlan(blocks, page, batch_tokens, needed, fixed + blocks * block, budget)


def generate_batch_arguments(model: torch.nn.Module, settings: dict[str, Any], row_tokens: list[int],
                             free_bytes: int) -> dict[str, Any]:
    """The keyword arguments of `model.generate_batch` (Transformers' continuous batching) for `settings` (a
    `GenerationConfig`'s, eos_token_id a list) over rows of `row_tokens` tokens each (prompt and answer cap), on a
    device with `free_bytes` free: where it takes `warmup` (5.25), none (it captures CUDA graphs first); where it
    takes a `ContinuousBatchingConfig` (5.25), the paged cache `paged_cache_plan` sizes (the blocks the rows need, no
    more than fit in CONTINUOUS_CACHE_MEMORY of the free memory; by default 5.25 would take 90 % of it, on a CPU most
    of the host's, which other processes then run out of); before 5.25 the first EOS id alone (4.57 compares a token
    with one id: the caller cuts after a later stop id), and 4.57 sizes its cache itself from the GPU's free
    memory (at most 4,096 blocks of 32 tokens)."""
    from transformers import GenerationConfig

    if TRANSFORMERS_RELEASE < CONTINUOUS_BATCHING_ON_CPU_FROM:
        settings = {**settings, "eos_token_id": settings["eos_token_id"][0]}
    parameters = inspect.signature(model.generate_batch).parameters
    arguments: dict[str, Any] = {"generation_config": GenerationConfig(**settings)}
    if "warmup" in parameters:
        arguments["warmup"] = False
    if "continuous_batching_config" in parameters:
        from transformers.generation import ContinuousBatchingConfig

        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        plan = paged_cache_plan(config, model.dtype, row_tokens, free_bytes)
        arguments["continuous_batching_config"] = ContinuousBatchingConfig(
            page_size=plan.page_size, num_blocks=plan.num_blocks, max_batch_tokens=plan.max_batch_tokens,
            max_memory_percent=CONTINUOUS_CACHE_MEMORY)
    return arguments
