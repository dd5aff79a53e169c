#!/usr/bin/env bash
# The first thing to run on a lent GPU (no internet there): environment, tests/test_cuda.py, a synthetic bench where
# `dflash-hf bench --synthetic` exists, eager against compiled steps on the proxy (scripts/step_ops_proxy.py), a few
# training steps in bf16 (scripts/training_throughput.py), a few at Qwen3-8B's shapes beside the cost model's numbers
# (scripts/training_plan_check.py), then the hybrid proxy in what is left.
# Installs nothing from the internet. Everything goes to stdout and, when $OUT is set, to $OUT/gpu_check.log
# (pytest's JUnit XML and the bench JSON next to it). 14 minutes at most (the proxy's four compilations, then the
# hybrid proxy in what is left).
#
#   bash scripts/gpu_check.sh                      # from the repository root
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   PYTEST_ARGS="-k memory" BENCH_ARGS="--num-prompts 2" bash scripts/gpu_check.sh
#
# Exit status: pytest's (the bench is informative only).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
RESULTS=${OUT:-$(mktemp -d)}
mkdir -p "$RESULTS"
STARTED=$SECONDS
section() { printf '\n===== %s (t=%ds) =====\n' "$*" "$((SECONDS - STARTED))"; }

main() {

section "machine"
date -u
timeout 20 nvidia-smi || echo "nvidia-smi failed or is missing"

# The Python with a CUDA torch: $PYTHON, else the repository's .venv (a carried one is usually a CPU build), python3, python.
section "python"
PY=""
FIRST=""
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    timeout 60 "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1
    case $? in
        0) PY=$candidate; break ;;  # torch with a CUDA device
        3) FIRST=${FIRST:-$candidate} ;;  # torch without one
    esac
done
if [ -z "$PY" ]; then
    PY=${FIRST:-python3}
    echo "WARNING: no Python here sees a CUDA device through torch; using $PY (the CUDA tests will skip)"
fi
echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"

# dflash_hf importable from outside the repository, or installed in place without dependencies or downloads.
if ! (cd / && timeout 60 "$PY" -c "import dflash_hf" >/dev/null 2>&1); then
    echo "dflash_hf is not installed: pip install -e . --no-deps --no-build-isolation"
    timeout 60 "$PY" -m pip install -q -e . --no-deps --no-build-isolation \
        || echo "WARNING: the editable install failed; running from the source tree (PYTHONPATH)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

section "versions"
timeout 60 "$PY" - <<'EOF' || echo "WARNING: the version report failed"
import importlib, platform
import torch
print("platform", platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        print(f"  cuda:{index} {properties.name}, {properties.total_memory / 2**30:.1f} GiB, "
              f"capability {properties.major}.{properties.minor}")
    print("  bf16 supported", torch.cuda.is_bf16_supported())
for name in ("transformers", "accelerate", "flash_attn", "safetensors", "tokenizers", "scipy", "pytest", "dflash_hf"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as error:  # missing, or broken against this torch
        print(name, "NOT IMPORTABLE:", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
EOF

section "tests/test_cuda.py"
# -rsP: the reasons for skips, and what the passing tests print (memory, host syncs per step, sampling p-values)
# shellcheck disable=SC2086
timeout "${PYTEST_TIMEOUT:-240}" "$PY" -m pytest -q -rsP -p no:cacheprovider tests/test_cuda.py \
    --junitxml "$RESULTS/test_cuda.xml" --durations 15 ${PYTEST_ARGS:-}
TEST_STATUS=$?
[ "$TEST_STATUS" -eq 124 ] && echo "WARNING: pytest ran past ${PYTEST_TIMEOUT:-240} s and was stopped"
echo "pytest exit status: $TEST_STATUS"

section "bench --synthetic"
if [ $((SECONDS - STARTED)) -gt "${BENCH_START_BEFORE:-330}" ]; then
    echo "skipped: ${BENCH_START_BEFORE:-330} s have passed (the whole check stays under 8 minutes)"
elif timeout 30 "$PY" -m dflash_hf.cli bench --help 2>/dev/null | grep -q -- --synthetic; then
    # shellcheck disable=SC2086
    # Qwen3-8B and its published draft with random weights, bfloat16, sdpa (no download): t(1), t(B), draft, projection
    timeout "${BENCH_TIMEOUT:-150}" "$PY" -m dflash_hf.cli bench --synthetic Qwen3-8B --batch-size 1 4 16 \
        --block-size 8 16 --context-length 1024 --json "$RESULTS/bench_synthetic.json" ${BENCH_ARGS:-}
    echo "bench exit status: $?"
    # Tree verifies at the same shapes: the cost per drafted node of trees of 16, 32 and 64 against the chain of 15
    timeout "${TREE_BENCH_TIMEOUT:-90}" "$PY" -m dflash_hf.cli bench --synthetic Qwen3-8B --block-size 16 \
        --tree-size 16 32 64 --tau 6.5 --context-length 1024 --json "$RESULTS/bench_synthetic_trees.json"
    echo "tree bench exit status: $?"
else
    echo "skipped: this version of dflash-hf bench has no --synthetic"
fi

section "compiled path: eager against compile=True (CUDA graphs) on a launch-bound proxy"
if [ -f scripts/step_ops_proxy.py ] && [ $((SECONDS - STARTED)) -lt "${PROXY_START_BEFORE:-450}" ]; then
    # A random Qwen3 of 36 layers, width 64 (the arithmetic is negligible: what remains is the launches), 96 tokens:
    # generate eager and compiled (static cache), the compiled forward alone over 1 and 16 tokens (the floor of a
    # compiled verify), chain and tree of 8, each eager and compiled (compiled trees and sliding-window targets are
    # also checked for exactness and CUDA graphs in tests/test_cuda.py); each row's first round prints as it comes
    timeout "${PROXY_TIMEOUT:-300}" "$PY" scripts/step_ops_proxy.py --device cuda --rounds 3
    echo "proxy exit status: $?"
else
    echo "skipped: no scripts/step_ops_proxy.py, or ${PROXY_START_BEFORE:-450} s have passed"
fi

section "training: a few steps of the real loop, one GPU, bf16, FSDP off"
# train_draft end to end (scripts/training_throughput.py): a random Qwen3-shaped target of 8 layers, width 1024, in
# bfloat16, the draft's forward under bf16 autocast, 8 sequences of 2,048 tokens, 512 anchors, blocks of 16; prints
# tokens/s and peak GPU memory. After the proxy (whose start it must not delay), with at least 4 minutes left of 14.
LEFT=$((${CHECK_SECONDS:-840} - (SECONDS - STARTED)))
if [ -f scripts/training_throughput.py ] && [ "$LEFT" -ge 240 ]; then
    timeout "${TRAIN_TIMEOUT:-120}" "$PY" scripts/training_throughput.py --hidden 1024 --target-layers 8 \
        --length 2048 --sequences 8 --anchors 512
    echo "training exit status: $?"
else
    echo "skipped: no scripts/training_throughput.py, or under 240 s left of ${CHECK_SECONDS:-840}"
fi

section "training at Qwen3-8B's shapes beside the cost model (dflash-hf train --plan's step time and memory)"
# A random Qwen3-8B target in bf16 and the published 5-layer draft's shape (scripts/training_plan_check.py): 3,072-token
# sequences, 512 anchors, one per step, FSDP off; the time per step from runs of 2 and 5 steps, tokens/s and peak GPU
# memory, beside the cost model's numbers for the same run. With at least 4 minutes left of 14.
# PLAN_CHECK_ARGS="--shrink 32 --tokens 256 --anchors 16" runs it on a CPU (a dry run: the numbers mean nothing).
# Then the same with --gradient-checkpointing, where 4 minutes are still left.
for CHECKPOINTING in "" "--gradient-checkpointing"; do
    LEFT=$((${CHECK_SECONDS:-840} - (SECONDS - STARTED)))
    if [ -f scripts/training_plan_check.py ] && [ "$LEFT" -ge 240 ]; then
        PLAN_LIMIT=$(( LEFT - 60 < ${PLAN_TIMEOUT:-240} ? LEFT - 60 : ${PLAN_TIMEOUT:-240} ))
        # shellcheck disable=SC2086
        timeout "$PLAN_LIMIT" "$PY" scripts/training_plan_check.py --steps 2 5 $CHECKPOINTING ${PLAN_CHECK_ARGS:-}
        echo "training plan check ${CHECKPOINTING:-without gradient checkpointing} exit status: $?"
    else
        echo "skipped ${CHECKPOINTING:-the run}: no scripts/training_plan_check.py, or under 240 s left of" \
            "${CHECK_SECONDS:-840}"
    fi
done

section "compiled path on a hybrid target: eager against compile=True on a Qwen3.5-shaped proxy"
# 32 layers of width 64, three Gated DeltaNet layers to each attention layer: the eager chain step (with its state
# rollback) against the compiled one (the rollback in fixed buffers, one more graph). Started only with at least
# 2 minutes left of 14, and stopped at 14, so the whole check fits 15 minutes of device time.
LEFT=$((${CHECK_SECONDS:-840} - (SECONDS - STARTED)))
if [ -f scripts/step_ops_proxy.py ] && [ "$LEFT" -ge 120 ]; then
    HYBRID_LIMIT=$(( LEFT < ${HYBRID_TIMEOUT:-300} ? LEFT : ${HYBRID_TIMEOUT:-300} ))
    timeout "$HYBRID_LIMIT" "$PY" scripts/step_ops_proxy.py --device cuda --hybrid --no-tree --new-tokens 48 --rounds 3
    echo "hybrid proxy exit status: $?"
else
    echo "skipped: no scripts/step_ops_proxy.py, or under 120 s left of ${CHECK_SECONDS:-840}"
fi

section "done"
echo "total $((SECONDS - STARTED)) s; pytest exit status $TEST_STATUS"
return "$TEST_STATUS"
}

if [ -n "${OUT:-}" ]; then
    main 2>&1 | tee -a "$RESULTS/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
main 2>&1
