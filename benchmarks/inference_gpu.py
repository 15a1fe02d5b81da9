"""Batched inference on a GPU: an ``InferenceHost`` whose model lives on CUDA, called by
CPU workers. Checks that every caller gets the rows computed from its own input (compared
with the same model on the CPU), and prints calls/s and mean batch at 1, 16 and 64
concurrent callers (threads, each with its own client). Needs a CUDA device::

    python benchmarks/inference_gpu.py            # exit 1 when no GPU or a wrong answer
"""

from __future__ import annotations

import copy
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tensorshare import Client, EmbeddedServer  # noqa: E402
from tensorshare.inference import InferenceClient, InferenceHost  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 8))
    gpu_model = copy.deepcopy(cpu_model).to("cuda")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    bad: list[str] = []
    with EmbeddedServer(port=0) as server, \
            InferenceHost("policy", gpu_model, "127.0.0.1", server.port, max_batch=1024,
                          max_wait_ms=1.0) as host, \
            Client("127.0.0.1", server.port) as stats:
        assert host.device is not None and host.device.type == "cuda", host.device
        for callers in (1, 16, 64):
            calls = 400 if callers == 1 else 100
            lat: list[float] = []
            lock = threading.Lock()
            barrier = threading.Barrier(callers + 1)

            def run(i: int, calls: int = calls, barrier: threading.Barrier = barrier,
                    lat: list[float] = lat, lock: threading.Lock = lock) -> None:
                x = torch.randn(64, generator=torch.Generator().manual_seed(i))
                with torch.no_grad():
                    want = cpu_model(x[None])[0]
                with InferenceClient("policy", "127.0.0.1", server.port, timeout=60) as pc:
                    pc.predict(x)
                    barrier.wait(60)
                    mine = []
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        out = pc.predict(x)
                        mine.append(time.perf_counter() - t0)
                        if out.device.type != "cpu" or not torch.allclose(out, want, atol=1e-4):
                            bad.append(f"caller {i}: {out} != {want}")
                with lock:
                    lat.extend(mine)

            before = stats.stats("policy")["bins"]["policy"]["service"]
            threads = [threading.Thread(target=run, args=(i,)) for i in range(callers)]
            for t in threads:
                t.start()
            barrier.wait(60)
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = stats.stats("policy")["bins"]["policy"]["service"]
            batches = after["batches"] - before["batches"]
            answered = after["answered"] - before["answered"]
            lat.sort()
            print(f"{callers:3d} callers: {len(lat) / wall:8,.0f} calls/s, p50 "
                  f"{statistics.median(lat) * 1e3:.2f} ms, p99 "
                  f"{lat[int(len(lat) * 0.99)] * 1e3:.2f} ms, mean batch "
                  f"{answered / max(batches, 1):.1f}")
    print("answers: " + ("all computed from their own input" if not bad else
                         f"{len(bad)} WRONG, e.g. {bad[0]}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
