"""Quick start: one worker rank and the scheduler-side client in one process.

Run it: ``python examples/quickstart.py``.  A serving engine does the same across processes
(the worker in each model-runner process, the client in the scheduler).
"""

from __future__ import annotations

import tempfile
import uuid

from lmprefetch import LookupClient, PrefetchConfig, WorkerRuntime


def main() -> None:
    with tempfile.TemporaryDirectory() as disk:
        config = PrefetchConfig(chunk_size=16, chunk_bytes=4096, cpu_bytes=1 << 20, disk_path=disk)
        tag = uuid.uuid4().hex[:8]
        worker_ep, sched_ep = f"ipc://@quickstart-{tag}-w0", f"ipc://@quickstart-{tag}-sched"

        with (
            WorkerRuntime.start(
                config, rank=0, world_size=1, request_endpoint=worker_ep, response_endpoint=sched_ep
            ) as worker,
            LookupClient(config, [worker_ep], sched_ep) as client,
        ):
            prompt = list(range(100))  # 6 full chunks of 16 tokens (+ 4 tokens never cached)
            # After a prefill, the model step stores one payload (its KV bytes) per chunk.
            stored = worker.store(prompt, [bytes([i]) * 4096 for i in range(6)])
            print(f"stored {stored} chunks")

            # The scheduler asks; the first call starts the lookup and returns None.
            assert client.lookup("req-1", prompt) is None
            hit = client.wait("req-1", timeout_s=5)  # a real scheduler polls once per step
            print(f"cached prefix: {hit} tokens")

            # The model step claims the prefetched chunks and copies them into its KV cache.
            with worker.claim("req-1") as chunks:
                print(
                    f"claimed {len(chunks)} chunks, first bytes {bytes(chunks[0][1].view()[:4])!r}"
                )
            client.forget("req-1")

            # A prompt that shares the first 3 chunks hits those only.
            other = prompt[:48] + [999] * 52
            client.lookup("req-2", other)
            print(f"second prompt: {client.wait('req-2', 5)} tokens cached")
            client.cancel("req-2")  # the request went away: release what the worker holds


if __name__ == "__main__":
    main()
