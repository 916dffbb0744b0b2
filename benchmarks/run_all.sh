#!/usr/bin/env bash
# Re-measure every benchmark, one after another, on an otherwise idle machine, and write
# benchmarks/results/*.json. Needs ../shared (Office-Caltech-10 images, CIFAR ResNet weights).
set -euo pipefail
cd "$(dirname "$0")/.."
export EMBEDCACHE_ASSETS="${EMBEDCACHE_ASSETS:-$(cd .. && pwd)/shared}"
export EMBEDCACHE_WEIGHTS="${EMBEDCACHE_WEIGHTS:-$EMBEDCACHE_ASSETS/weights}"
PY=${PY:-.venv/bin/python}
for b in engine memory fedncm predict extract store_read fingerprint backbone_speed finetune text_encoder heap_policy; do
  echo "== bench_$b $(date -u +%H:%M:%S)"
  case $b in
    extract) args="--per-domain 0" ;;   # all 2,533 Office-Caltech-10 images
    engine) args="" ;;                  # 1 thread and every core, 7 interleaved repeats
    memory) args="--baseline-rev 72227fd" ;;  # before/after the copies were removed (issue 11)
    *) args="" ;;
  esac
  "$PY" "benchmarks/bench_$b.py" $args
done
echo "== bench_predict_images $(date -u +%H:%M:%S)"   # fedheads predict --images end to end, cold and warm cache
"$PY" benchmarks/bench_predict_images.py
echo "== bench_cached_vs_live $(date -u +%H:%M:%S)"
"$PY" benchmarks/bench_cached_vs_live.py --rounds 100 --live-rounds 5
echo "== bench_flower $(date -u +%H:%M:%S)"   # needs the [flower] extra (part of [dev])
"$PY" benchmarks/bench_flower.py
echo "== bench_feddra $(date -u +%H:%M:%S)"   # FedDRA: stage-1 cache vs live, methods at --preset quick, 3 seeds
"$PY" benchmarks/bench_feddra.py
echo "== done $(date -u +%H:%M:%S)"
