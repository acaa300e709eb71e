"""``launch.run_local_ranks``: the ranks' environment, a failed rank, and the group's one deadline, on `sh` ranks
(no torch in the ranks, so these are cheap)."""

from __future__ import annotations

import pytest

from torchnitro.distributed.launch import RankRun, run_local_ranks
from torchnitro.errors import InputError

_ENV = 'echo "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS [$CUDA_VISIBLE_DEVICES]"'


def test_every_rank_gets_its_rank_and_one_shared_rendezvous():
    run = run_local_ranks(["sh", "-c", _ENV], 3, timeout=60)
    assert not run.failed and run.returncodes == [0, 0, 0]
    fields = [out.split() for out in run.outputs]
    assert [(f[0], f[1]) for f in fields] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert all(f[2:5] == ["3", "3", "127.0.0.1"] and f[6:] == ["1", "[]"] for f in fields)
    assert len({f[5] for f in fields}) == 1 and int(fields[0][5]) > 0  # one free port for the whole group


def test_a_failed_rank_is_reported_with_its_output_not_raised():
    run = run_local_ranks(["sh", "-c", 'echo "out of rank $RANK" >&2; [ "$RANK" = 1 ] && exit 3; exit 0'], 2,
                          timeout=60)
    assert run.failed and not run.timed_out and run.returncodes == [0, 3]
    assert run.outputs[1] == "out of rank 1\n"  # stderr comes with stdout
    log = run.log(5)
    assert "--- rank 0 (rc=0) ---\nnk 0\n" in log and "--- rank 1 (rc=3) ---\nnk 1\n" in log  # the last 5 chars


def test_the_deadline_kills_every_rank():
    # rank 1 would sleep far past the deadline: it is killed, not waited for (this test ends, it does not hang)
    run = run_local_ranks(["sh", "-c", '[ "$RANK" = 1 ] && exec sleep 600; exit 0'], 2, timeout=2)
    assert run.timed_out and run.failed
    assert run.returncodes[1] < 0  # killed by a signal


def test_no_ranks_is_an_input_error():
    with pytest.raises(InputError, match="received world=0"):
        run_local_ranks(["true"], 0, timeout=1)


def test_a_clean_run_is_not_failed():
    assert not RankRun([0, 0], ["", ""], timed_out=False).failed
    assert RankRun([0, 0], ["", ""], timed_out=True).failed
