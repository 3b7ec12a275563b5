#!/usr/bin/env bash
# One batched session on a lent GPU machine (device time is scarce): GPU tests, both benchmarks and a
# GPU smoke run of the three CLIs on a tiny target. Every step runs even if an earlier one failed;
# results land in $OUT (JSON per benchmark, one log per step). Wheels missing on the image travel in
# .carry/wheels (zarr and its dependencies for CPython 3.12), or in .carry_a/wheels
# (a superset, downloaded by bench/carry_assets.py).
#   OUT=/tmp/out bash bench/gpu_session.sh [steps...]      steps: env tests train store_io extract decode_attention topk regenerate smoke stash_a stash_c stash_d send_parts quality scale chat
# The real-model quality bench needs the SmolLM2 GGUF, too big for one upload: two consecutive calls on
# the same warm machine, call 1 carrying .carry_a and running `stash_a` (keeps the first half in
# /tmp/smollm2), call 2 carrying .carry_b and running `quality` or `scale` (joins, checks the sha256,
# runs the bench). Call 2 must follow within the machine's 30 s warm time. QUALITY_ARGS, TRAIN_ARGS, EXTRACT_ARGS, REGEN_ARGS, ATTN_ARGS ("--steps 1000 ...") append flags to those steps;
# GPU_TESTS narrows the tests step (default: tests/gpu tests/test_speculative.py); SMOKE_ARCH=dflash2 smokes
# the DFlash-2 drafter, SMOKE_TRAIN_FLAGS (e.g. --no-compile-drafter) go to its dflash-train; SCALE_PLAN names the plan of the scale step (a file of bench/quality_scale.py stages
# with deadlines, relative to the checkout; format in bench/scale_plan.sh; default bench/plans/scale_dflash_dflash2.plan;
# SCALE_TRAIN_FLAGS, e.g. --no-compile-drafter, is appended to each of its train lines);
# PACK_REPLIES=NAME makes the scale step end by packing store NAME's replies into $OUT/replies_NAME.tar.xz
# (bench/replies_archive.py; moved into .carry_b/scale, a plan's `regenerate --replies-archive` starts from it).
# An archive too big to ride with .carry_b (the temperature-1 replies: 13.3 MiB beside .carry_b's 57 MiB) goes
# in .carry_c/scale instead: a call carrying .carry_c runs `stash_c` (keeps it in /tmp/carry_scale) between
# the stash_a call and the scale calls, which take it into the plan's prompts folder.
# PACK_DRAFTERS="NAME ..." makes the scale step end by cutting those runs' drafters (final, else the latest
# checkpoint's; bfloat16) into parts of <= 15 MiB (bench/drafter_parts.py) and bringing back the first 3; each
# later call's `send_parts` step brings back 4 more (a DFlash-2 of SmolLM2's width is 6 parts). Moved into
# .carry_d/ (at most 4 parts a call), calls carrying it run `stash_d`, and the next scale step unpacks them into
# its runs, to evaluate without training.
# The scale step compiles into /tmp/qs/inductor (TORCHINDUCTOR_CACHE_DIR; the trainer's first start on a bare
# machine took >151 s, a resumed one 45 s): PACK_INDUCTOR=1 ends it by packing that cache into
# $OUT/inductor_cache.tar.xz; moved to .carry_a/, stash_a keeps it and the next machine's scale step starts warm.
set -u
OUT=${OUT:?set OUT to a results folder}
export PYTHONUNBUFFERED=1
steps=${*:-env tests train extract smoke}
# one wheels folder: the first that exists (.carry_a's hold .carry's too; stash_a keeps them in
# /tmp/carry_wheels for the calls carrying .carry_b, which has none)
for wheels in .carry_a/wheels .carry/wheels /tmp/carry_wheels; do [ -d $wheels ] && break; done
[ -d $wheels ] || { echo "no wheels: carry .carry or .carry_a (or run stash_a on this machine before carrying .carry_b)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $wheels/*.whl . || { echo "install failed"; exit 1; }
# the checkout has a dflash_pipeline/ folder of its own: keep the cwd off sys.path so the installed package wins
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
status=0

# the SmolLM2 GGUF from stash_a's half in /tmp/smollm2 and .carry_b's half, sha256-checked: $d/$name
join_smollm2() {
  d=/tmp/smollm2
  [ -f $d/part-1 ] || { echo "no $d/part-1: this machine is not the warm one where step stash_a ran (carrying .carry_a); run that call again first"; return 1; }
  read -r _ name < $d/sha256
  [ -f $d/$name ] && return 0
  [ -f .carry_b/smollm2/part-2 ] || { echo "no .carry_b/smollm2/part-2: carry .carry_b"; return 1; }
  cat $d/part-1 .carry_b/smollm2/part-2 > $d/$name
  (cd $d && sha256sum -c sha256) || { echo "$d/$name: sha256 mismatch (parts from different carry_assets runs?)"; rm -f $d/$name; return 1; }
  mkdir -p /tmp/qs && cp -r .carry_b/scale /tmp/qs/prompts 2>/dev/null || true
}
export -f join_smollm2

step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, record the exit code
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1  # killed 5 s on if it ignores SIGTERM
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}

for s in $steps; do
  case $s in
    env) step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton, transformers, zarr; print(torch.__version__, triton.__version__, transformers.__version__, zarr.__version__, torch.cuda.get_device_name())"; nproc; df -h /tmp | tail -1' ;;
    tests) step tests 300 python3 -m pytest ${GPU_TESTS:-tests/gpu tests/test_speculative.py} -m gpu -q -s -p no:cacheprovider ;;
    train) step bench_train 420 python3 -m bench.train --scratch /tmp/bench_train --json "$OUT/train.json" ${TRAIN_ARGS:-} ;;
    store_io) step bench_store_io 120 python3 -m bench.store_io --scratch /tmp/bench_store_io --json "$OUT/store_io.json" ;;
    decode_attention) step bench_decode_attention 180 python3 -m bench.decode_attention --json "$OUT/decode_attention.json" ${ATTN_ARGS:-} ;;
    topk) step bench_topk 120 python3 -m bench.topk --vocab 49152 --vocab 151936 --group 512 --group 1024 --group 4096 --json "$OUT/topk.json" ;;
    regenerate) step bench_regenerate 500 python3 -m bench.regenerate --json "$OUT/regenerate.json" ${REGEN_ARGS:-} ;;
    extract) step bench_extract 480 python3 -m bench.extract --out-dir /tmp/bench_extract --json "$OUT/extract.json" --samples 480 ${EXTRACT_ARGS:-} ;;
    smoke) step smoke 240 bash -c '
      set -e; d=/tmp/smoke; rm -rf $d
      python3 -c "import sys; from dflash_pipeline.data.tiny_target import build_tiny_target as b; b(sys.argv[1], num_layers=6, hidden=128)" $d/target
      dflash-extract --target $d/target --data data/sample/conversations.jsonl --out $d/store --gpus 0 --max-length 512 --regenerate --max-new-tokens 64 --limit 128
      dflash-train --store $d/store --out $d/train --gpus 0 --arch ${SMOKE_ARCH:-dflash} --num-layers 2 --block-size 8 \
        --pack-tokens 2048 --num-blocks 128 --max-steps 60 --eval-every 30 --checkpoint-every 30 --lr 2e-3 --eval-samples 16 ${SMOKE_TRAIN_FLAGS:-}
      dflash-eval --target $d/target --drafter $d/train/drafter --prompts data/sample/conversations.jsonl \
        --limit 8 --max-new-tokens 64 --device cuda --dtype float32 --json '"$OUT"'/smoke_eval.json
      tail -n 3 $d/train/metrics.jsonl' ;;
    stash_a) step stash_a 60 bash -c '
      set -e; [ -f .carry_a/smollm2/part-1 ] || { echo "no .carry_a/smollm2/part-1: carry .carry_a"; exit 1; }
      mkdir -p /tmp/smollm2 /tmp/carry_wheels; cp .carry_a/smollm2/* /tmp/smollm2/
      cp .carry_a/wheels/*.whl /tmp/carry_wheels/; ls -l /tmp/smollm2 /tmp/carry_wheels
      if [ -f .carry_a/inductor_cache.tar.xz ]; then cp .carry_a/inductor_cache.tar.xz /tmp/; fi' ;;
    stash_d) step stash_d 60 bash -c '
      set -e; [ -d .carry_d ] || { echo "no .carry_d: carry .carry_d"; exit 1; }
      mkdir -p /tmp/carry_drafters; cp .carry_d/drafter_* /tmp/carry_drafters/; ls -l /tmp/carry_drafters' ;;
    send_parts) step send_parts 60 python3 -m bench.drafter_parts send --parts /tmp/drafter_parts --out "$OUT" --max-parts 4 ;;
    stash_c) step stash_c 60 bash -c '
      set -e; [ -d .carry_c/scale ] || { echo "no .carry_c/scale: carry .carry_c"; exit 1; }
      mkdir -p /tmp/carry_scale; cp .carry_c/scale/* /tmp/carry_scale/; ls -l /tmp/carry_scale' ;;
    quality) step quality 480 bash -c '
      set -e; join_smollm2; rm -rf /tmp/quality
      python3 -m bench.quality --device cuda --gguf $d/$name --prompts .carry_b/smollm2 --out /tmp/quality \
        --json '"$OUT"'/quality.json --train-prompts 6000 --eval-prompts 16 --max-new-tokens 256 \
        --eval-max-new-tokens 128 --steps 2000 --num-layers 2 --block-size 16 \
        --pack-tokens 4096 --num-blocks 256 --loader-workers 8 '"${QUALITY_ARGS:-}"'' ;;
    # bench/quality_scale.py in one call on the warm machine where stash_a ran (carrying .carry_b): the
    # lines of SCALE_PLAN (default bench/plans/scale_dflash_dflash2.plan; the format: bench/scale_plan.sh),
    # each under its deadline in seconds since this step began, each stage resuming on a rerun, the report
    # rewritten after every line so a cut call still returns what it measured.
    # Measured in one 10-minute call: --limit 1200 conversations regenerate in ~110 s, 600 steps of a
    # 5-layer drafter train in ~125 s, and one evaluation of --limit 8 --max-new-tokens 96 takes ~55 s.
    # On a bare machine the GGUF conversion takes ~50 s first, and a regenerate line with --store-topk
    # did not end within 112 s for 1,000 conversations (replies 31 s, extraction 15 s; the notes'
    # times in the log now show where the rest goes).
    scale) step scale 585 bash -c '
      t0=$(date +%s); set -e; join_smollm2
      export TORCHINDUCTOR_CACHE_DIR=/tmp/qs/inductor
      if [ ! -d $TORCHINDUCTOR_CACHE_DIR ] && [ -f /tmp/inductor_cache.tar.xz ]; then
        mkdir -p $TORCHINDUCTOR_CACHE_DIR && tar -xJf /tmp/inductor_cache.tar.xz -C $TORCHINDUCTOR_CACHE_DIR
      fi
      if [ -d /tmp/carry_scale ]; then cp /tmp/carry_scale/* .carry_b/scale/; fi  # stash_c
      if [ -d /tmp/carry_drafters ]; then python3 -m bench.drafter_parts unpack --parts /tmp/carry_drafters --runs /tmp/qs/run; fi  # stash_d
      [ -d /tmp/qs/target ] || python3 -c "import sys; from pathlib import Path; from bench.compression import smollm2_folder; smollm2_folder(Path(\"/tmp/qs/target\"), Path(sys.argv[1]))" $d/$name
      set +e; bash bench/scale_plan.sh "${SCALE_PLAN:-bench/plans/scale_dflash_dflash2.plan}" /tmp/qs/run .carry_b/scale \
        /tmp/qs/target '"$OUT"'/quality_scale.json $t0
      rc=$?; [ -f '"$OUT"'/quality_scale.json ] && cat '"$OUT"'/quality_scale.json
      if [ -n "'"${PACK_REPLIES:-}"'" ]; then
        python3 -m bench.quality_scale pack-replies --out /tmp/qs/run --store "'"${PACK_REPLIES:-}"'" \
          --archive '"$OUT"'/replies_'"${PACK_REPLIES:-}"'.tar.xz || rc=1
      fi
      for r in '"${PACK_DRAFTERS:-}"'; do python3 -m bench.drafter_parts pack --run /tmp/qs/run/$r --parts /tmp/drafter_parts || rc=1; done
      if [ -d /tmp/drafter_parts ]; then python3 -m bench.drafter_parts send --parts /tmp/drafter_parts --out '"$OUT"' --max-parts 3 || rc=1; fi
      if [ -n "'"${PACK_INDUCTOR:-}"'" ]; then
        XZ_OPT=-T0 tar -cJf '"$OUT"'/inductor_cache.tar.xz -C $TORCHINDUCTOR_CACHE_DIR . && ls -l '"$OUT"'/inductor_cache.tar.xz || rc=1
      fi
      # every evaluation with its per-prompt steps (accepted counts per verify step), for analyses here,
      # and their logs (a cut or failed one says there how far it got), in one archive: a call brings
      # back at most 8 files from $OUT (unpack here: tar -xJf evaluations.tar.xz)
      cd /tmp/qs/run && shopt -s nullglob && files=(eval_*.json ngram_N*.json) && [ -d logs ] && files+=(logs)
      [ ${#files[@]} -eq 0 ] || tar -cJf '"$OUT"'/evaluations.tar.xz "${files[@]}" || rc=1
      exit $rc' ;;
    # real conversations through regenerate_records with and without prefix reuse, on the SmolLM2 folder
    # that a scale step made on this machine (bench/regenerate.py --chat; CHAT_ARGS appends flags)
    chat) step chat 200 bash -c '
      [ -d /tmp/qs/target ] || { echo "no /tmp/qs/target: run the scale step on this machine first"; exit 1; }
      python3 -m bench.regenerate --target /tmp/qs/target --chat .carry_b/scale/train_conversations.jsonl.xz \
        --reuse-prefixes on --reuse-prefixes off --json '"$OUT"'/chat.json '"${CHAT_ARGS:-}"'' ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
