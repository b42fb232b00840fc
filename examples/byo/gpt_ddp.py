"""Train a small GPT with DDP: a plain torch script, runnable with python or torchrun.

The lines marked ``# hpclaunch`` are all it takes to get hpclaunch's guarantees (every rank stops
after the same step with a save on a scheduler's warning, requeue, restarts in place, bitwise
resume). Without them this is the same script.

    python gpt_ddp.py --steps 200                              # one process
    torchrun --nproc-per-node 2 gpt_ddp.py --steps 200         # DDP; SIGTERM stops it with a save
    hpclaunch train --script gpt_ddp.py --set scheduler.procs_per_node=2 -- --steps 200
    hpclaunch submit --script gpt_ddp.py cluster.yaml -- --steps 20000
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from gpt import GPT, Windows, synthetic_corpus
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import hpclaunch  # hpclaunch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
p.add_argument("--block", type=int, default=32)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--d-model", type=int, default=64)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--workers", type=int, default=1)
p.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step (tests)")
args = p.parse_args()

distributed = "WORLD_SIZE" in os.environ
cuda = torch.cuda.is_available()
if distributed:
    dist.init_process_group("nccl" if cuda else "gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)  # the same initial weights on every rank
model = GPT(vocab=64, block=args.block, n_layer=args.layers, n_head=4, d_model=args.d_model).to(device)
train_module = DDP(model, device_ids=[device] if cuda else None) if distributed else model
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
data = Windows(synthetic_corpus(vocab=64, length=20_000), args.block)
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers, drop_last=True)
torch.manual_seed(1000 + rank)  # each rank's own dropout

run = hpclaunch.attach(model=train_module, optimizer=opt, scheduler=sched, data=loader)  # hpclaunch
for step, (x, y) in zip(run.steps(total=args.steps), run.batches()):  # hpclaunch
    loss = train_module(x.to(device), y.to(device))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % 10 == 0 or step == args.steps:
        run.log(loss=loss.item(), lr=sched.get_last_lr()[0])  # hpclaunch
    if args.sleep:
        import time

        time.sleep(args.sleep)

if rank == 0:  # reached only when every step is done
    torch.save(model.state_dict(), "gpt_ddp.pt")
if distributed:
    dist.destroy_process_group()
