#!/usr/bin/env bash
# One prepared call for a lent GPU (docs/speed.md), about 6 minutes on an H200: the GPU check with
# both samplers' tokens/s at 64 rows x 256 and x 512 tokens, then one bench run at the Qwen2.5-0.5B
# shape (random weights, 8 questions x 8 answers x 256 tokens, bf16): our GRPO and SC-GRPO and
# TRL's GRPOTrainer, then the packages' versions. The device's own CUDA torch is used; transformers,
# trl, accelerate, datasets and peft travel as wheels (see the device tool's notes).
#
#     bash tools/gpu_session.sh DIR            # outputs in DIR (e.g. $OUT), else in docs/bench/
#     bash tools/gpu_session.sh DIR --small    # the same at toy sizes, on a CPU: a dry run
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-docs/bench}; mkdir -p "$dir"
if [ "${2:-}" = "--small" ]; then
    check=(--gpu-check --small --device cpu)
    bench=(--model random:qwen-tiny --prompts-per-step 2 --group-size 4 --max-new-tokens 8 --micro-batch 8 --steps 1)
else
    check=(--gpu-check)
    bench=(--model random:qwen2.5-0.5b --prompts-per-step 8 --group-size 8 --max-new-tokens 256 --micro-batch 16
           --grad-checkpoint --steps 3)
fi
stamp=$(date +%F)_$(git rev-parse --short HEAD 2>/dev/null || echo nocommit)
"${PYTHON:-python}" tools/bench.py "${check[@]}" --out "$dir/${stamp}_gpu_check.md"
"${PYTHON:-python}" tools/bench.py "${bench[@]}" --impls grpo@bf16 scgrpo@bf16 trl@bf16 --out "$dir/${stamp}_bench.md"
"${PYTHON:-python}" - > "$dir/${stamp}_versions.txt" <<'EOF'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
for p in ("transformers", "trl", "accelerate", "datasets", "peft", "tokenizers"):
    print(p, m.version(p))
EOF
ls -l "$dir"
