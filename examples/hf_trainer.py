"""A Hugging Face Trainer script with Ballast turned on by one line (the
callbacks= argument): flash checkpoints every step, step reports, and on a
restart the Trainer resumes from Ballast's newest step (memory, a peer's
replica or disk) through its own resume path. A tiny GPT-2 built from a
config and random tokens: nothing is fetched from a model hub.

    ballast launch --python PY --nodes 1 --nproc-per-node 2 examples/hf_trainer.py --ckpt /tmp/hf-ckpt

(PY: an interpreter with torch 2.x, transformers, accelerate and ballast,
e.g. the venv `make torch2` builds.)
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ballast.hf import BallastCallback

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True)
p.add_argument("--out", default="/tmp/hf-trainer-out")
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=256, length=32, vocab=1000):
        self.data = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=32, n_embd=64, n_layer=2, n_head=2))
training_args = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                                  learning_rate=5e-4, save_strategy="no", report_to=[], logging_steps=5,
                                  use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(),
                  callbacks=[BallastCallback(args.ckpt)])          # <- the one line
trainer.train()

# End the process group before the interpreter exits: torch 2.x's gloo backend
# can otherwise abort at exit ("terminate called without an active exception")
# while it still cleans up the Trainer's last collective, and the agent then
# restarts a job that had finished.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
