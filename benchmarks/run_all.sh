#!/usr/bin/env bash
# Re-measure every committed benchmark, one after another, on an otherwise idle machine, and write
# benchmarks/results/*.json (each records its command, commit, machine and load average).
# Needs ../shared (Office-Caltech-10 images, CIFAR ResNet weights).
#   bash benchmarks/run_all.sh            # the figures (hours: the paper-scale pipelines alone ~35 min)
#   bash benchmarks/run_all.sh --quick    # smoke pass: each benchmark's smallest mode, results to a temp dir
# Peer frameworks for bench_peers: benchmarks/requirements-peers.txt, installed into ../peers_site.
# GPU figures: benchmarks/gpu_check.sh on a CUDA machine (and bench_engine_ab.py for an A/B of two commits).
set -euo pipefail
cd "$(dirname "$0")/.."
export EMBEDCACHE_ASSETS="${EMBEDCACHE_ASSETS:-$(cd .. && pwd)/shared}"
export EMBEDCACHE_WEIGHTS="${EMBEDCACHE_WEIGHTS:-$EMBEDCACHE_ASSETS/weights}"
PY=${PY:-.venv/bin/python}
QUICK=0; [ "${1:-}" = "--quick" ] && QUICK=1
OUT=benchmarks/results
if [ $QUICK = 1 ]; then OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT; fi

# name | arguments for the figures | arguments for --quick ("-": no smoke mode, skipped)
while IFS='|' read -r name full quick; do
  name=$(echo $name); [ -z "$name" ] && continue
  if [ $QUICK = 1 ]; then
    quick=$(echo $quick)
    if [ "$quick" = "-" ]; then echo "== $name: no smoke mode, skipped in --quick"; continue; fi
    args="$quick"
  else
    args="$full"
  fi
  script=${name%%:*}
  echo "== $name $(date -u +%H:%M:%S): $script.py $args"
  # shellcheck disable=SC2086
  "$PY" "benchmarks/$script.py" ${args//@OUT/$OUT}
done <<'TABLE'
bench_engine               |                                                   | --quick --out @OUT/engine.json
bench_memory               | --baseline-rev 72227fd                            | --quick --out @OUT/memory.json
bench_fedncm               |                                                   | -
bench_predict              |                                                   | -
bench_extract              | --per-domain 0                                    | --per-domain 3 --out @OUT/extract.json
bench_store_read           |                                                   | --quick
bench_fingerprint          |                                                   | --quick
bench_startup              | --repeats 5                                       | --quick
bench_import               | --clients 1000,10000                              | --quick
bench_backbone_speed       |                                                   | --quick --out @OUT/backbone_speed.json
bench_finetune             |                                                   | --quick --out @OUT/finetune.json
bench_peft                 | --work ~/bench-peft-work                          | --quick --out @OUT/peft.json
bench_text_encoder         |                                                   | --quick --out @OUT/text_encoder.json
bench_heap_policy          |                                                   | -
bench_predict_images       |                                                   | --quick --out @OUT/predict_images.json
bench_cached_vs_live       | --rounds 100 --live-rounds 5                      | -
bench_flower               |                                                   | --quick --out @OUT/flower.json
bench_peers                | --site ../peers_site --rounds crossdevice=30,skewed=30 | --quick --site ../peers_site --out @OUT/peers.json
bench_feddra               |                                                   | --quick --out @OUT/feddra.json
bench_scale                | --clients 1000 --layouts bucketed --repeats 3     | --quick --out @OUT/scale.json
bench_scale_breakdown      |                                                   | -
bench_privacy_utility      |                                                   | --small --out @OUT/privacy_utility.json
bench_scale_inat           | --repeats 3 --algorithms fedncm,fed3r,fedcof,fedcof:dtype=float32,fedncm:layout=streamed,fed3r:layout=streamed,fedcof:layout=streamed,fedcof:dtype=float32,layout=streamed,afl,ghofl,fedcgs,ghofl:head=qda --mem-limit-gb 12 --timeout 400 --profile fedcof:layout=streamed | --quick --out @OUT/scale_inat.json
bench_pipelines:ci         | --scale ci --scheduler local:2 --out-dir runs/bench-pipelines | --experiments fedpcl-table2 --scale smoke --scheduler serial --out @OUT/pipelines.json
bench_pipelines:ci_compare | --experiments fedpcl-table14,fedpcl-table2,fedpcl-table3 --scale ci --scheduler local:2 --compare serial --out benchmarks/results/pipelines_ci_compare.json | -
bench_pipelines:paper      | --scale paper --out-dir runs/bench-pipelines --warm-only --out benchmarks/results/pipelines_paper.json | -
TABLE
echo "== done $(date -u +%H:%M:%S)"
