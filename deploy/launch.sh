#!/usr/bin/env bash
# Start SGLang and nextstate for a local model directory on this machine's GPUs.
#
#   deploy/launch.sh /models/Qwen3-4B            # one GPU: SGLang and the learner share it
#   GPUS=2 deploy/launch.sh /models/Qwen3-8B     # two GPUs: SGLang on GPU 0, the learner on GPU 1
#
# SGLang listens on 127.0.0.1 only (its admin routes load adapters and weights: never expose
# them); nextstate on NEXTSTATE_HOST:NEXTSTATE_PORT. Ctrl-C or SIGTERM stops exactly the two
# processes this script started, nothing else.
set -euo pipefail

MODEL=${1:?usage: deploy/launch.sh MODEL_DIR}
GPUS=${GPUS:-1}
SGLANG_PORT=${SGLANG_PORT:-30000}
LORA_R=${NEXTSTATE_LORA_R:-16}
LORA_TARGETS=${NEXTSTATE_LORA_TARGET_MODULES:-q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj}
MAX_LORAS=${MAX_LORAS_PER_BATCH:-8}   # adapters in one batch, base-model requests included
if [ "$GPUS" -ge 2 ]; then MEM_FRACTION=${MEM_FRACTION:-0.85}; else MEM_FRACTION=${MEM_FRACTION:-0.55}; fi

pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait || true
}
trap stop EXIT INT TERM

# SGLANG_RETURN_ORIGINAL_LOGPROB=1: sampled-token logprobs at temperature 1, like the prompt-token
# logprobs the OPD teacher reads (engine/sglang.py; nextstate refuses a server without it).
SGLANG_RETURN_ORIGINAL_LOGPROB=1 CUDA_VISIBLE_DEVICES=0 python3 -m sglang.launch_server \
  --model-path "$MODEL" --host 127.0.0.1 --port "$SGLANG_PORT" \
  --enable-lora --max-lora-rank "$LORA_R" --lora-target-modules ${LORA_TARGETS//,/ } \
  --max-loras-per-batch "$MAX_LORAS" --mem-fraction-static "$MEM_FRACTION" &
pids+=($!)

echo "waiting for SGLang on 127.0.0.1:$SGLANG_PORT ..."
for _ in $(seq 1 600); do
  if curl -fsS "http://127.0.0.1:$SGLANG_PORT/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "${pids[0]}" 2>/dev/null; then echo "SGLang exited" >&2; exit 1; fi
  sleep 1
done

if [ "$GPUS" -ge 2 ]; then LEARNER_GPU=1; else LEARNER_GPU=0; fi
CUDA_VISIBLE_DEVICES=$LEARNER_GPU \
NEXTSTATE_ENGINE=sglang NEXTSTATE_SGLANG_URL="http://127.0.0.1:$SGLANG_PORT" \
NEXTSTATE_MODEL="$MODEL" NEXTSTATE_LEARNER_DEVICE=cuda NEXTSTATE_LORA_R="$LORA_R" \
NEXTSTATE_LORA_TARGET_MODULES="$LORA_TARGETS" \
  nextstate serve &
pids+=($!)
wait -n "${pids[@]}"
