"""The loss of a whole node, from inside a training script (the test
workers train_ckpt.py and tests/python/fsdp_worker.py share it).

Once per job (a marker file in OUT: a world that starts over must not lose
a node again), at a step every rank has saved: all ranks wait a second for
the agents to copy the step to their peers, then rank `kill_rank` removes
its agent's shared memory (every store of that agent and the replicas it
held for others: a lost host's memory goes with it) and SIGKILLs its agent
and itself. Collective: every rank calls it at the same step.
"""

import glob
import os
import signal
import time

import torch.distributed as dist


def marker(out):
    return os.path.join(out, "node-lost")


def lost_already(out):
    return os.path.exists(marker(out))


def lose_node(out, rank, kill_rank, step, log):
    """log(kind, **fields): the script's event log ("kill-node" is written
    before the kill)."""
    dist.barrier()
    time.sleep(1.0)  # the agents copy the step to their peers meanwhile (milliseconds)
    dist.barrier()
    if rank != kill_rank:
        return
    log("kill-node", step=step)
    open(marker(out), "w").close()
    prefix = os.environ["BALLAST_CKPT_SHM"].rsplit("-", 1)[0]
    for path in glob.glob("/dev/shm" + prefix + "-*"):
        os.unlink(path)
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
