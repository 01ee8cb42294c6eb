"""``PagedEngine.from_pretrained(folder, tensor_parallel_size=2, distributed_executor_backend=BACKEND)``: the engine
starts its follower itself. Prints one JSON line: the tokens of one process and of two ranks, the processes left
after ``shutdown()``, and what a dead follower does to the next ``generate``.

    python tests/distributed/tp_launch.py DIR mp|ray
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time

from paged_hf import PagedEngine, SamplingParams

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33], [1, 5, 9, 13, 17, 40, 41], [1, 2, 3]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS = dict(block_size=4, num_blocks=64, enable_prefix_caching=True)


def tokens(engine) -> list:
    return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def kill_follower(executor) -> None:
    """Kills rank 1 the hard way (a crash, an OOM kill) and waits until it is gone."""
    if executor.backend == "mp":
        process = executor._handles[0]
        process.kill()
        process.join(10)
    else:
        import ray  # noqa: PLC0415

        ray.kill(executor._handles[0])
        ray.wait(executor._refs, timeout=10)


def main(folder: str, backend: str) -> None:
    result = {"one": tokens(PagedEngine.from_pretrained(folder, **OPTIONS))}

    engine = PagedEngine.from_pretrained(folder, tensor_parallel_size=2, distributed_executor_backend=backend,
                                         distributed_timeout=60, **OPTIONS)
    result["two"] = tokens(engine)
    result["again"] = tokens(engine)  # prefix hits on the second run
    stats = engine.get_stats()
    result["tp"], result["hit_rate"] = stats.tensor_parallel_size, stats.prefix_cache_hit_rate
    engine.shutdown()
    result["left_after_shutdown"] = len(multiprocessing.active_children())

    engine = PagedEngine.from_pretrained(folder, tensor_parallel_size=2, distributed_executor_backend=backend,
                                         distributed_timeout=60, **OPTIONS)
    kill_follower(engine.runner.executor)
    started = time.monotonic()
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    result["dead_errors"] = [out.error for out in outs]
    result["dead_seconds"] = time.monotonic() - started
    engine.shutdown()
    result["left_after_dead"] = len(multiprocessing.active_children())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
