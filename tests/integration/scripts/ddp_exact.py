"""DDP whose gradients are bit for bit the same in a restarted world as in an
uninterrupted one (the test workers train_ckpt.py and health_train.py share it).

gloo's ring allreduce adds an element's contributions in an order that
depends on where the element sits in the reduced buffer, and DDP lays out
its buckets differently in a fresh process (first iteration, then rebuilt by
gradient ready order) than in a long-running one. Reducing parameter by
parameter makes every element's order independent of the bucket layout.
"""

import torch
import torch.distributed as dist


def per_parameter_allreduce(state, bucket):
    """DDP comm hook: allreduce each parameter's slice of the bucket on its own."""
    world = dist.get_world_size()
    buf = bucket.buffer()
    offset = 0
    for prm in bucket.parameters():
        n = prm.numel()
        dist.all_reduce(buf[offset:offset + n])
        offset += n
    buf.div_(world)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut
