"""DeepSpeed's CPU allreduce leaves a 64 MiB segment per rank in /dev/shm at every multi-rank
CPU run; ds_hybrid.initialize unlinks them once every rank has mapped them."""
from spawn import run_ranks


def test_initialize_unlinks_deepspeeds_cpu_allreduce_segments(tmp_path):
    ranks = run_ranks("shm_worker.py", [], 2, tmp_path, env={"LOCAL_SIZE": "2"})
    assert all(rep["shm_op"] for rep in ranks), "DeepSpeed's shared-memory op was not set up: nothing tested"
    for rep in ranks:
        assert rep["left"] == [], f"segments left in /dev/shm after initialize: {rep['left']}"
        assert rep["sum"] == [3.0], "the shared-memory allreduce no longer adds the ranks' values after the unlink"
