"""A Hugging Face Trainer script with Ballast turned on by one line
(callbacks=[BallastCallback(...)]), for tests/python/test_hf.py: a tiny GPT-2
built from a config (nothing fetched from a model hub), random token data,
DDP over gloo on CPU. With --kill-step S, rank --kill-rank SIGKILLs itself
right after step S's flash save, on the job's first attempt only.
Rank 0 writes OUT/result.json: the final weights' sha256, the step the last
start resumed from and the load's source.
"""

import argparse
import hashlib
import json
import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ballast.hf import BallastCallback

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--save-every", default="1", help="N, or auto[:MAX] (Ballast picks the interval)")
args = p.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=97):
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Fault(TrainerCallback):
    def on_step_end(self, a, state, control, **kwargs):
        if (state.global_step == args.kill_step and int(os.environ.get("RANK", 0)) == args.kill_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)


# No dropout: the run is then a function of the data order and the weights,
# which the resume restores exactly.
config = GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
targs = TrainingArguments(output_dir=os.path.join(args.out, "hf"), max_steps=args.steps,
                          per_device_train_batch_size=2, learning_rate=1e-3, lr_scheduler_type="linear",
                          warmup_steps=2, save_strategy="no", report_to=[], logging_steps=1, seed=0,
                          use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True)
ballast_cb = BallastCallback(args.ckpt, save_every=int(args.save_every) if args.save_every.isdigit() else args.save_every)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[ballast_cb, Fault()])
trainer.train()
# As the example does: torch 2.x's gloo can abort at interpreter exit while it
# cleans up the last collective (a core dump showed ProcessGroupGloo's thread
# taking the GIL in Py_Finalize), and the job would restart from step 12.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()

if trainer.args.process_index == 0:
    h = hashlib.sha256()
    for k, v in sorted(trainer.model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({"sha256": h.hexdigest(), "resumed_step": ballast_cb.resumed_step,
                   "reserved_bytes": ballast_cb.reserved_bytes,
                   "params": sum(p.numel() for p in trainer.model.parameters()),
                   "source": ballast_cb.ckpt.last_load_source, "global_step": trainer.state.global_step,
                   "world": trainer.args.world_size}, f)
