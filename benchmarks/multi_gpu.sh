#!/usr/bin/env bash
# Multi-GPU runs of examples/train_clip.py on one host, each launch time-limited, aggregated under $OUT
# (summary.json, summary.md, multi_gpu.log by multi_gpu_summary.py; run folders go to $WORK). PHASES:
#   ddp     a. DDP throughput: int8 at 1/2/4 GPUs, bf16 (--switchback off) at 1/4, same per-GPU batch
#   ddp2    a. on a 2-GPU host instead: int8 on 1 GPU, then on 2, one after the other
#   same    b. same loss: 1 GPU x 2B vs 2 GPUs x B, same seed (the synthetic stream gives both the same samples)
#   resume  c. FSDP2 and ZeRO-2 on 2 GPUs: 20 steps, checkpoints at 10 and 20; a second launch resumes from 10;
#           losses compared, the final model loaded with plain transformers (hf_switchback not imported)
#   zero3   c. the same with ZeRO-3
#   logits  d. logit memory, tiny CLIP, 8192 pairs per GPU on LOGIT_GPUS: --local_loss vs global loss
#
# usage: [OUT=DIR] [PHASES=...] [BUDGET=S] [SMOKE=1] bash benchmarks/multi_gpu.sh [--help]
#   OUT=/path bash benchmarks/multi_gpu.sh                # the 4-GPU run (PHASES="ddp resume zero3 same logits")
#   PHASES="ddp2 zero3 logits" LOGIT_GPUS=0,1 OUT=/path bash benchmarks/multi_gpu.sh   # the 2-GPU host
#   SMOKE=1 OUT=/tmp/smoke bash benchmarks/multi_gpu.sh   # dry run of the same logic on the CPU (tiny, gloo)
set -u
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'  # this header
    exit 0
fi
START=$(date +%s)
SMOKE=${SMOKE:-0}
OUT=${OUT:-runs/multi_gpu}
WORK=${WORK:-/tmp/multi_gpu_work}
BUDGET=${BUDGET:-525}  # seconds for all launches; the summary needs ~20 more
PHASES=${PHASES:-ddp resume zero3 same logits}
LOGIT_GPUS=${LOGIT_GPUS:-0,1,2,3}
LOGIT_NPROC=$(($(echo "$LOGIT_GPUS" | tr -cd , | wc -c) + 1))
want() { [[ " $PHASES " == *" $1 "* ]]; }
if want ddp && want ddp2; then
    echo "PHASES: ddp and ddp2 write the same run names (ddp_int8_1gpu, ddp_int8_2gpu); pick one" >&2
    exit 2
fi
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
LOG="$OUT/multi_gpu.log"
: >"$LOG"
RUNS="$WORK/runs.tsv"
: >"$RUNS"

if [ "$SMOKE" = 1 ]; then
    # .whl_ds holds a cp312 pydantic-core for the GPU host; a CPU dry run brings its own deepspeed via PYTHONPATH
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD/.whl/site:$PWD/.whl_ds/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 WANDB_MODE=disabled
export TRITON_CACHE_AUTOTUNING=1  # later launches reuse the first one's autotuned GEMM configs
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ "$SMOKE" = 1 ] && PY=.venv/bin/python

if [ "$SMOKE" = 1 ]; then
    export OMP_NUM_THREADS=1
    DDP=accelerate_configs/cpu.yaml FSDP=accelerate_configs/fsdp2.yaml SINGLE=accelerate_configs/cpu.yaml
    MODEL=()  # the embedded default (32 px, 2 layers of width 128)
    B=16 STEPS=8 WORKERS=0 B_SAME=8 STEPS_SAME=4 B_C=8 CKPT=3 STEPS_C=6 B_LOGITS=64 STEPS_LOGITS=3
    DS_NPROC=1  # accelerate's DeepSpeed path on the CPU only works with one process (see README)
    T_THR=200 T_SAME=200 T_C=200 T_LOGITS=200
else
    DDP=accelerate_configs/multi_gpu.yaml FSDP=accelerate_configs/fsdp2.yaml SINGLE=accelerate_configs/single_gpu.yaml
    MODEL=(--model_config examples/configs/clip-vit-b-16.json)
    # ViT-B/16 at 224 px: ~1.4k generated samples/s per CPU core (measured); 16 cores per GPU on the host
    B=128 STEPS=60 WORKERS=8 B_SAME=64 STEPS_SAME=20 B_C=64 CKPT=10 STEPS_C=20 B_LOGITS=8192 STEPS_LOGITS=6
    DS_NPROC=2
    T_THR=110 T_SAME=100 T_C=100 T_LOGITS=75
fi
COMMON=(--eval_steps 0 --max_eval_samples 64 --report_to none --seed 0 --local_loss --gather_with_grad)

log() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# launch NAME TIMEOUT GPUS NPROC CONFIG PORT -- train_clip args...   (output_dir = $WORK/NAME)
launch() {
    local name=$1 limit=$2 gpus=$3 nproc=$4 config=$5 port=$6
    shift 7
    local left=$((START + BUDGET - $(date +%s)))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        log "SKIP $name: out of time"
        printf '%s\tskipped\t0\n' "$name" >>"$RUNS"
        return 1
    fi
    local t0
    t0=$(date +%s)
    log "START $name (gpus $gpus, $nproc proc, $config, timeout ${limit}s)"
    local env_gpus=()
    [ "$SMOKE" = 1 ] || env_gpus=(env "CUDA_VISIBLE_DEVICES=$gpus")
    "${env_gpus[@]}" timeout -k 10 "$limit" "$PY" -m accelerate.commands.launch --config_file "$config" \
        --num_processes "$nproc" --main_process_port "$port" \
        examples/train_clip.py --output_dir "$WORK/$name" "${COMMON[@]}" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$RUNS"
    log "END $name rc=$rc ($(($(date +%s) - t0))s)"
    return $rc
}

# a. DDP throughput. 4-GPU runs alone; the 1- and 2-GPU runs side by side on disjoint GPUs.
THR=("${MODEL[@]}" --batch_size "$B" --max_train_steps "$STEPS" --logging_steps 5 --num_workers "$WORKERS")
if want ddp; then
launch ddp_int8_4gpu $((T_THR + 40)) 0,1,2,3 4 "$DDP" 29601 -- "${THR[@]}"
launch ddp_bf16_4gpu "$T_THR" 0,1,2,3 4 "$DDP" 29602 -- "${THR[@]}" --switchback off
launch ddp_int8_2gpu "$T_THR" 0,1 2 "$DDP" 29603 -- "${THR[@]}" &
launch ddp_int8_1gpu "$T_THR" 2 1 "$DDP" 29604 -- "${THR[@]}" &
launch ddp_bf16_1gpu "$T_THR" 3 1 "$DDP" 29605 -- "${THR[@]}" --switchback off &
wait
fi
if want ddp2; then
    launch ddp_int8_1gpu "$T_THR" 0 1 "$SINGLE" 29606 -- "${THR[@]}"
    launch ddp_int8_2gpu "$T_THR" 0,1 2 "$DDP" 29607 -- "${THR[@]}"
fi

# c. checkpoint + resume: first launch to STEPS_C (checkpoints at CKPT and STEPS_C), drop the last checkpoint,
# second launch resumes from `latest` (= CKPT) in the same output_dir and reruns the rest.
resume_pair() {
    local name=$1 gpus=$2 nproc=$3 config=$4 port=$5
    local args=("${MODEL[@]}" --batch_size "$B_C" --max_train_steps "$STEPS_C" --checkpointing_steps "$CKPT"
        --logging_steps 1 --num_workers 2)
    launch "$name" "$T_C" "$gpus" "$nproc" "$config" "$port" -- "${args[@]}" || return
    cp "$WORK/$name/train_log.jsonl" "$WORK/$name/train_log_first.jsonl"
    rm -rf "$WORK/$name/checkpoints/step_$STEPS_C" "$WORK/$name/model.safetensors"
    launch "${name}_resumed" "$T_C" "$gpus" "$nproc" "$config" $((port + 50)) -- "${args[@]}" \
        --resume_from_checkpoint latest --output_dir "$WORK/$name"
}
if want resume; then
    resume_pair fsdp2 0,1 2 "$FSDP" 29611 &
    resume_pair deepspeed_zero2 2,3 "$DS_NPROC" accelerate_configs/deepspeed_zero2.yaml 29612 &
    wait
fi

# b. same loss (GPUs 2,3, then 2) beside c. ZeRO-3 (GPUs 0,1)
want zero3 && resume_pair deepspeed_zero3 0,1 "$DS_NPROC" accelerate_configs/deepspeed_zero3.yaml 29613 &
want same && (
    SAME=("${MODEL[@]}" --max_train_steps "$STEPS_SAME" --logging_steps 1 --num_workers 1 --lr 5e-4
        --warmup_steps 5)
    launch same_loss_2gpu "$T_SAME" 2,3 2 "$DDP" 29621 -- "${SAME[@]}" --batch_size "$B_SAME"
    launch same_loss_1gpu "$T_SAME" 2 1 "$DDP" 29622 -- "${SAME[@]}" --batch_size $((2 * B_SAME))
) &
wait

# d. logit memory: the embedded tiny CLIP, so the logits dominate; local (n x N) vs global (N x N) loss
# Each DataLoader worker builds whole batches from its share of the stream, so keep workers few and the set
# large enough for STEPS_LOGITS batches per worker (8 workers x 25k samples made no 8192 batch on the GPU run).
LOGITS=(--batch_size "$B_LOGITS" --max_train_steps "$STEPS_LOGITS" --logging_steps 1 --num_workers 2
    --synthetic_train_samples $((LOGIT_NPROC * 2 * B_LOGITS * (STEPS_LOGITS + 1))))
if want logits; then
    launch "logits_local_${LOGIT_NPROC}gpu" "$T_LOGITS" "$LOGIT_GPUS" "$LOGIT_NPROC" "$DDP" 29631 -- "${LOGITS[@]}" \
        --local_loss
    launch "logits_global_${LOGIT_NPROC}gpu" "$T_LOGITS" "$LOGIT_GPUS" "$LOGIT_NPROC" "$DDP" 29632 -- \
        "${LOGITS[@]}" --no-local_loss
fi

# Summary: summary.json + summary.md under $OUT; each run's log tail goes into the combined log.
timeout 120 "$PY" benchmarks/multi_gpu_summary.py "$WORK" "$OUT" 2>&1 | tee -a "$LOG"
for f in "$WORK"/*.log; do
    {
        echo "===== $(basename "$f") (last 60 lines)"
        tail -n 60 "$f"
    } >>"$LOG"
done
log "done"
