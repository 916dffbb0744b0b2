"""faiss prototype prediction throughput vs numpy brute force on the same queries.

Both sides do the full job of `fedheads.prediction.prototypes.predict_features`: normalise (cosine),
score every present prototype, take the top-k, nearest first. numpy: one float32 GEMM per
chunk + argpartition/argsort; faiss: IndexFlatIP / IndexFlatL2 through the typed wrapper
(which adds casting checks and deterministic tie-breaking). Agreement of the top-1 labels is
reported (it can differ only on float near-ties).

Timings on a machine shared with other jobs are noisy; the load average is recorded.

With --faiss-gpu it also times faiss on the GPU (the same typed wrapper, use_gpu=True) and
reports its speed-up over faiss on the CPU and its top-1 agreement; where this faiss build has
no GPU support, or no GPU is visible, the JSON says so instead ("faiss_gpu").

Usage: python benchmarks/bench_predict.py [--queries 100000 --dim 512 --classes 100] [--faiss-gpu]
Writes benchmarks/results/predict.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import faiss
import numpy as np

from fedheads.prediction.prototypes import RULES, gpu_available, predict_features

HERE = Path(__file__).resolve().parent


def numpy_predict(protos: np.ndarray, present: np.ndarray, rule: str, x: np.ndarray, k: int,
                  chunk_rows: int) -> np.ndarray:
    p = protos[present]
    ids = np.flatnonzero(present)
    if rule == "cosine":
        p = p / np.linalg.norm(p, axis=1, keepdims=True)
    pn = (p * p).sum(1)
    out = np.empty((x.shape[0], k), np.int64)
    for s in range(0, x.shape[0], chunk_rows):
        q = x[s:s + chunk_rows]
        if rule == "cosine":
            key = -(q / np.linalg.norm(q, axis=1, keepdims=True)) @ p.T
        else:
            key = (q * q).sum(1)[:, None] - 2 * q @ p.T + pn[None]
        part = np.argpartition(key, k - 1, axis=1)[:, :k] if k < p.shape[0] else \
            np.broadcast_to(np.arange(p.shape[0]), key.shape)
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, 1), 1), 1)
        out[s:s + chunk_rows] = ids[order]
    return out


def bench(fn, repeats: int) -> float:
    fn()  # warm-up (thread pools, page faults)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--chunk-rows", type=int, default=16_384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS and OpenMP threads for both sides (threadpoolctl + faiss); 0 = "
                         "library defaults. Default 1: on a shared, oversubscribed machine "
                         "multi-threaded GEMMs mostly measure the other jobs")
    ap.add_argument("--faiss-gpu", action="store_true", help="also time faiss on the GPU (when it has GPU support)")
    ap.add_argument("--out", default=str(HERE / "results" / "predict.json"))
    a = ap.parse_args()
    gpu = a.faiss_gpu and gpu_available()
    if not a.faiss_gpu:
        gpu_note = "not measured (no --faiss-gpu)"
    elif gpu:
        gpu_note = f"measured on {faiss.get_num_gpus()} GPU(s)"
    else:
        gpu_note = ("unavailable: this faiss build has no GPU support" if not hasattr(faiss, "StandardGpuResources")
                    else "unavailable: faiss sees no GPU")
    if a.threads > 0:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=a.threads)
        faiss.omp_set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    protos = rng.normal(size=(a.classes, a.dim)).astype(np.float32)
    present = np.ones(a.classes, bool)
    present[::10] = False  # some classes absent, as on a real client
    x = (rng.normal(size=(a.queries, a.dim)) + protos[rng.integers(0, a.classes, a.queries)]
         ).astype(np.float32)
    rows = []
    for rule in RULES:
        for k in (1, 5):
            tf = bench(lambda rule=rule, k=k: predict_features(protos, present, rule, x, k=k,
                                                chunk_rows=a.chunk_rows, use_gpu=False), a.repeats)
            tn = bench(lambda rule=rule, k=k: numpy_predict(protos, present, rule, x, k, a.chunk_rows), a.repeats)
            got = predict_features(protos, present, rule, x, k=k, chunk_rows=a.chunk_rows,
                                   use_gpu=False).topk_labels
            ref = numpy_predict(protos, present, rule, x, k, a.chunk_rows)
            rows.append({"rule": rule, "k": k,
                         "faiss_seconds": round(tf, 4), "numpy_seconds": round(tn, 4),
                         "faiss_queries_per_s": round(a.queries / tf),
                         "numpy_queries_per_s": round(a.queries / tn),
                         "speedup_faiss_over_numpy": round(tn / tf, 3),
                         "top1_agreement": float(np.mean(got[:, 0] == ref[:, 0]))})
            if gpu:
                tg = bench(lambda rule=rule, k=k: predict_features(protos, present, rule, x, k=k,
                                                    chunk_rows=a.chunk_rows, use_gpu=True), a.repeats)
                on_gpu = predict_features(protos, present, rule, x, k=k, chunk_rows=a.chunk_rows,
                                          use_gpu=True).topk_labels
                rows[-1].update({"faiss_gpu_seconds": round(tg, 4), "faiss_gpu_queries_per_s": round(a.queries / tg),
                                 "speedup_faiss_gpu_over_cpu": round(tf / tg, 3),
                                 "top1_agreement_gpu_vs_cpu": float(np.mean(on_gpu[:, 0] == got[:, 0]))})
            print(rows[-1], flush=True)
    from bench_fedncm import machine  # same machine description in both results files
    from machine_info import write_json  # sibling module (benchmarks/ is on sys.path)

    result = {"benchmark": "nearest-prototype prediction: faiss Flat vs numpy brute force",
              "queries": a.queries, "dim": a.dim, "classes": a.classes,
              "present_classes": int(present.sum()), "chunk_rows": a.chunk_rows,
              "repeats": a.repeats, "threads": a.threads, "faiss": faiss.__version__, "faiss_omp_threads":
              faiss.omp_get_max_threads(), "faiss_gpu": gpu_note, "numpy": np.__version__, "results": rows,
              "load_average_at_end": os.getloadavg(), "machine": machine()}
    write_json(result, a.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
